"""Where cached chunks live: the host tier, the disk tier, the remote tier.

``host/``: the shared-memory arena and its index, quotas, warm restarts.
``disk/``: chunk files, the disk index, demotion and promotion with the host.
``remote/``: store clients, values, zero-copy IO, checksum processes, policy.
Here: what every tier shares (``scope``, ``progress``, ``daemon_threads``).

Layers: host imports no other tier; disk imports host; remote imports host and
disk (the chunk format). Imports: kvd_protocol only. Tiers never copy engine
pages (that is kvd.copy / kvd.cuda) and never see sockets or sessions. No
package here re-exports names: import from the module that defines them.
"""
