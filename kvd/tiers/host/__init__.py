"""The host tier: cached chunks in one shared-memory arena that outlives the daemon.

Owns the arena file (``arena``), its extent allocator (``allocator``), the
index of chunks with pins (``tier``, over ``entry``) and its LRU eviction
(``eviction``, over ``lru``), quotas per model and tenant (``quota``), and the warm restart: the
arena's index file (``arena_index``), kept in step with checksums
(``journal``, ``seal_queue``) and rebuilt by the next daemon (``adopt``).

Imports: kvd.tiers' shared modules and kvd_protocol; never another tier.
"""
