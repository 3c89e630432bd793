"""The interface of a remote chunk store, and its Valkey/Redis backend.

A backend is a blocking client the remote tier calls only from its threads, under timeouts
and a breaker. Values are opaque bytes (kvd.tiers.remote.value), names strings. Methods
(failures raise, ``RemoteError`` where the store reports one): ``connect`` (never at daemon
start-up), ``ping``, ``exists(names)``, ``get``, optional ``get_many``, ``put``, ``delete``
(best effort), ``close``, optional zero-copy ``lend``/``put_from``/``get_into``.
Backends: ``RedisStore`` (``address`` a redis://, rediss:// or unix:// URL) and
``MooncakeStore``; a bad address raises ``ValueError`` at construction. Client libraries are
imported by ``connect`` only, so kvd without the extras still starts.
"""

from __future__ import annotations

import logging

from kvd.tiers.remote import redis_arena
from kvd.tiers.remote.errors import RemoteError, unless_all_failed

log = logging.getLogger("kvd")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
# redis-py reads a reply this many bytes at a time (its default, 64 KiB, costs a Python-level
# loop turn per 64 KiB of a multi-MiB value: ~20% of a 4 MiB GET on loopback)
READ_BYTES = 1 << 20
BUFFER_CUTOFF = 6000  # redis-py's own: arguments longer than this are sent as their own buffers


def _python_packer() -> dict:
    """redis-py's own command serializer, also where hiredis is installed: it sends a large
    value as a buffer of its own, while hiredis's (redis-py's default with hiredis) copies
    it into one string: 4 MiB SETs measured 3-4 times slower with it (docs/cluster.md).
    Replies are still parsed by hiredis where it is installed (faster gets)."""
    try:
        from redis.connection import Encoder, PythonRespSerializer
    except ImportError:  # a redis-py without pluggable serializers: its own is Python's
        return {}
    return {"command_packer": PythonRespSerializer(BUFFER_CUTOFF, Encoder("utf-8", "strict",
                                                                          False).encode)}


class RedisStore:
    """Valkey or Redis through the ``redis`` client (kvd-cache's ``redis`` extra)."""

    name = "redis"
    batch_bytes = 4 << 20  # a zero-copy call's values (a larger one alone): pipelined, not parallel

    def __init__(self, address: str, timeout_s: float, ttl_s: int = 0, zero_copy: bool = True):
        if not address.startswith(REDIS_SCHEMES):
            raise ValueError(f"a Valkey/Redis address is a URL ({', '.join(REDIS_SCHEMES)}), "
                             f"got {address!r}")
        self.address = address
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s or None
        self.client = None
        self.want_zero_copy = zero_copy
        self.zero_copy_off = "remote_redis_zero_copy = false" if not zero_copy else \
            "no host arena lent"
        self.said = False  # the path's state was logged

    @property
    def zero_copy(self) -> bool:
        return not self.zero_copy_off

    def lend(self, ptr: int, size: int) -> None:
        """The host arena is there for ``put_from``/``get_into`` (they take its addresses)."""
        if self.want_zero_copy:
            self.zero_copy_off = ""

    def connect(self) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        if self.client is not None:
            self.client.close()
        # no retries inside the client: a failure goes to the breaker at once; RESP2 (redis-py 8
        # speaks RESP3 by default) unless the address asks otherwise: the zero-copy path reads
        # GET replies off the socket itself (kvd/tiers/remote/redis_arena.py)
        self.client = redis.Redis.from_url(
            self.address, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0,
            client_name="kvd", socket_read_size=READ_BYTES, protocol=2, **_python_packer())
        if not self.said:  # once: connect runs again after every failure
            self.said = True
            if self.zero_copy_off:
                log.info("remote tier: Redis zero-copy path off (%s): values go through Python "
                         "bytes", self.zero_copy_off)
            else:
                log.info("remote tier: Redis zero-copy path on: chunks are sent from the host "
                         "arena and GET replies read straight into it")

    def ping(self) -> None:
        if not self.client.ping():
            raise RemoteError("PING was not answered with PONG")

    def exists(self, names: list) -> list:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in pipe.execute()]

    def get(self, name: str):
        return self.client.get(name)

    def get_many(self, names: list) -> list:
        return self.client.mget(names)

    def put(self, name: str, value) -> None:
        self.client.set(name, value, ex=self.ttl_s)

    def put_from(self, names: list, heads: list, ptrs: list, sizes: list) -> list:
        """Store each ``heads[i]`` then the ``sizes[i]`` arena bytes at ``ptrs[i]`` as one
        value, pipelined on one connection: per value None (stored) or its ``RemoteError``;
        raises when every value failed."""
        return unless_all_failed(self._on_connection(
            lambda conn: redis_arena.put_from(conn, names, heads, ptrs, sizes, self.ttl_s)))

    def get_into(self, names: list, head_len: int, ptrs: list, size: int) -> list:
        """GET values of ``head_len + size`` bytes, pipelined on one connection, each one's
        payload into the arena at ``ptrs[i]``: per value its head (bytes), None when absent,
        the stored size when another (its slot may hold some of it), or its
        ``RemoteError``; raises when every value failed."""
        return unless_all_failed(self._on_connection(
            lambda conn: redis_arena.get_into(conn, names, head_len, ptrs, size)))

    def _on_connection(self, io):
        """``io(conn)`` on a connection of the pool; one that failed midway is closed (its
        stream may be out of step), never handed out again as it is."""
        pool = self.client.connection_pool
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py before 5.3 wants a command name
            conn = pool.get_connection("GET")
        try:
            return io(conn)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def delete(self, name: str) -> None:
        self.client.delete(name)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

