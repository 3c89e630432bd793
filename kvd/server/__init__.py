"""The daemon process: sockets, sessions, the service ops, control and stats.

Owns the event loop (``daemon``: start-up, the two ROUTER sockets, the
reaper, shutdown), the runtime directory on the daemon's side
(``runtime_dir``), the host tier at start-up and exit (``host_tier``:
adopt the arena a previous daemon left, or allocate one), client sessions with their registrations and leases
(``sessions``), one method per engine op (``service``), operator ops
(``control``) and counters (``stats``). All state lives on the one event
loop: no locks.

Imports: kvd.tiers, kvd.copy, kvd.cuda (lazily: only with a GPU), kvd.config
and kvd_protocol. Nothing below imports kvd.server.
"""
