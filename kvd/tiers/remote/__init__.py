"""The remote tier: chunks shared through an existing distributed store (Valkey/Redis, Mooncake).

Owns the store clients (``store``: the interface and Redis; ``mooncake``;
``redis_arena``), the value format (``value``, the chunk file's header and
checksums), IO that never makes a request slow (``tier``, over ``calls``
and ``breaker``), the zero-copy path (``zero_copy``) with checksum processes
(``digest_pool``, ``digest_worker``), reused buffers (``buffers``), the
store's error (``errors``) and the policy with the host tier (``tiering``).
Client libraries are imported only when a store connects.

Imports: kvd.tiers.host, kvd.tiers.disk, kvd.tiers' shared modules, kvd_protocol.
"""
