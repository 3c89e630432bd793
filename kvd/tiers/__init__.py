"""Where cached chunks live: the host arena and index, the disk tier, the policy between.

Owns the shared-memory arena (``arena``) and its extent allocator
(``allocator``), the host tier's index with LRU eviction and pins
(``host``, over ``entry`` records and the ``lru`` queue), what lets the
arena outlive the daemon (``arena_index``: the index file's format;
``journal``: keeping it in step, checksums; ``adopt``: rebuilding the host
tier from it, verification), the disk tier's chunk files (``chunk_file``:
format, checksums, crash-safe writes; ``disk_scan``: recovery scan; ``digest``: the segmented
payload digest) and index (``disk``), and demotion/promotion between host
and disk (``tiering``); quotas per model and tenant (``quota``: each
group's bytes and counters, the eviction choices that keep caps and
reservations); the remote tier on an existing distributed store:
its store clients (``remote_store``: the interface and Valkey/Redis;
``remote_mooncake``: Mooncake Store), value format (``remote_value``), IO
with timeouts and a circuit breaker (``remote``, ``breaker``,
``daemon_threads``) and its policy (``remote_tiering``). Client libraries
(redis, mooncake) are imported only when a store connects.

Imports: kvd_protocol only. Tiers never copy engine pages (that is
kvd.copy / kvd.cuda) and never see sockets or sessions.
"""
