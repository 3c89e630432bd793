"""Where cached chunks live: the host tier, the disk tier, the remote tier, the policy between.

Owns the shared-memory arena with its allocator, index, LRU and pins (host tier, kept
across restarts by its index file and journal), the disk tier's checksummed chunk files,
demotion and promotion between host and disk (``tiering``), quotas per model and tenant,
and the remote tier on an existing store (Valkey/Redis, Mooncake) with timeouts and a
circuit breaker. Store client libraries are imported only when a store connects.
Imports: kvd_protocol only. Never copies engine pages (kvd.copy / kvd.cuda do) and never
sees sockets or sessions.
"""
