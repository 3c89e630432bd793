"""The disk tier: one checksummed file per chunk, and the policy that moves chunks to and from the host.

Owns the chunk file format and its IO (``chunk_file``, with the segmented
payload ``digest`` that the GPU and the remote tier check too), the disk
index with its LRU and IO threads (``tier``, over ``entry``), its recovery
at start-up (``recovery``, ``scan``), and demotion and promotion between
the host tier and the disk (``tiering``).

Imports: kvd.tiers.host, kvd.tiers' shared modules, kvd_protocol.
"""
