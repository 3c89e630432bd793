"""Policy between the host tier and a remote store: publication and promotion.

Lookups walk host, then disk, then remote (shared, a network round trip away).
Publication (``publish``: at "store" or at "demote") queues chunks for the store, bounded by
``queue_chunks`` (more dropped and counted; none while the breaker is open); a chunk the
store holds is not sent again; host entries are pinned only while packed, never during
network IO. Promotion: ``lookup`` asks which keys past the local prefix the store holds and
starts fetching them; ``promote_prefix`` returns the ready entries, pinned (``fetches`` for
loads that copy runs as they land). A fetch is checked (header, digest, keyed tag) before
its reservation is committed: any failure is a miss, never wrong bytes; a bad value is
counted and deleted. Zero-copy stores take kvd.tiers.remote.zero_copy.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from kvd.tiers.disk.chunk_file import ChunkCorrupt
from kvd.tiers.disk.tiering import hold_ready
from kvd.tiers.host.tier import HostTier
from kvd.tiers.remote import zero_copy
from kvd.tiers.remote.buffers import ValueBuffers
from kvd.tiers.remote.digest_pool import DigestPool
from kvd.tiers.remote.tier import RemoteTier
from kvd.tiers.remote.value import Seal, copy_verified, pack, parse, value_bytes
from kvd_protocol.errors import ServerError

log = logging.getLogger("kvd")
PUBLISH = ("store", "demote")
BATCH_BYTES = 4 << 20  # one get_many round trip fetches at most this much


class RemoteTiering:
    def __init__(self, host: HostTier, remote: RemoteTier, view, publish: str = "store",
                 queue_chunks: int = 256, seal: Seal | None = None, digests=None):
        if publish not in PUBLISH:
            raise ValueError(f"publish must be one of {PUBLISH}, got {publish!r}")
        self.host = host
        self.remote = remote
        self.view = view  # the arena's bytes (numpy uint8)
        self.base = view.ctypes.data
        if hasattr(remote.store, "lend"):  # registered by the store for the zero-copy path
            remote.store.lend(self.base, view.nbytes)
        self.publish = publish
        self.queue_chunks = queue_chunks
        self.seal = seal  # remote_secret: values carry a keyed tag, and need a valid one
        # the zero-copy path's checksums: in processes where the pool has them
        self.digests = digests if digests is not None else DigestPool(None, view.nbytes)
        self.promoting: dict[bytes, asyncio.Future] = {}
        self.shard_bytes: dict[bytes, int] = {}  # per namespace, for fetches of lookups without a layout
        self.publishing: dict[bytes, asyncio.Task] = {}  # a task may put a run of chunks
        self.batches: set = set()  # zero-copy fetches of runs of chunks
        # threads: at most a quarter put, half fetch, the rest answer lookups' exists calls
        self.parallel(max(1, remote.net.size // 4), max(1, remote.net.size // 2))
        self.counters: Counter = Counter()

    @property
    def zero_copy(self) -> bool:
        """Chunks move between the arena and the store without copies (the store registered
        the arena; kvd/tiers/remote/zero_copy.py)."""
        return getattr(self.remote.store, "zero_copy", False)

    def parallel(self, puts: int, fetches: int) -> None:
        """At most ``puts`` puts and ``fetches`` fetches in flight (twice ``puts`` values
        packed or being sent)."""
        self.put_slots = asyncio.Semaphore(puts)
        self.pack_slots = asyncio.Semaphore(2 * puts)
        self.buffers = ValueBuffers(2 * puts)
        self.fetch_slots = asyncio.Semaphore(fetches)

    def start(self) -> None:
        self.remote.start()

    async def stop(self) -> None:
        for task in list(self.publishing.values()):
            task.cancel()
        await asyncio.gather(*self.publishing.values(), *self.promoting.values(),
                             *self.batches, return_exceptions=True)
        await self.remote.stop()
        self.digests.close()  # after the CPU threads that ask it

    # ---- publication ---------------------------------------------------------------

    def stored(self, entries) -> None:
        """A store committed ``entries``: queue the ready ones (``publish = "store"``)."""
        if self.publish == "store":
            self.offer_many([e for e in entries if e.ready])

    def demoting(self, entry) -> None:
        """The disk tier's demoter took ``entry`` (``publish = "demote"``)."""
        if self.publish == "demote":
            self.offer_many([entry], cold=True)

    def offer(self, entry, cold: bool = False) -> None:
        self.offer_many([entry], cold)

    def offer_many(self, entries: list, cold: bool = False) -> None:
        """Queue puts of ``entries`` but those queued, known remote, or that cannot be now;
        one exists round trip for them all decides which the store lacks."""
        todo: dict = {}
        for entry in entries:
            if entry.part or entry.key in self.publishing or entry.key in todo or \
                    self.remote.name(entry.ns, entry.key) in self.remote.known:
                continue
            if not self.remote.breaker.allow():
                self.counters["publish_skipped"] += 1  # local-only while the store is away
                continue
            if len(self.publishing) + len(todo) >= self.queue_chunks:
                self.counters["publish_dropped"] += 1
                continue
            todo[entry.key] = entry
        if not todo:
            return
        check = asyncio.ensure_future(self.remote.present(
            [self.remote.name(e.ns, e.key) for e in todo.values()]))
        entries = list(todo.values())
        per = zero_copy.batch_chunks(self, entries[0].size) if self.zero_copy else 1
        for i in range(0, len(entries), per):  # zero-copy: a run of chunks a store call
            run = entries[i:i + per]
            task = asyncio.ensure_future(self._publish(run, cold, check, i))
            for entry in run:
                self.shard_bytes[entry.ns] = entry.shard_bytes
                self.publishing[entry.key] = task
                task.add_done_callback(lambda t, k=entry.key: self._published(k, t))

    def _published(self, key: bytes, task: asyncio.Task) -> None:
        if self.publishing.get(key) is task:
            del self.publishing[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("remote publication failed", exc_info=task.exception())

    async def _publish(self, run: list, cold: bool, check: asyncio.Future, first: int) -> None:
        present = await asyncio.shield(check)  # the batch's exists answer (None: unknown)
        todo = []
        for i, entry in enumerate(run, first):
            if present is not None and present[i]:
                self.remote.there(self.remote.name(entry.ns, entry.key))
            else:
                todo.append(entry)
        if not todo:
            return
        if not self.zero_copy:
            await asyncio.gather(*(self._publish_bytes(e, cold, present is not None)
                                   for e in todo))
            return
        async with self.pack_slots:
            live = self._live(todo)
            if live:
                sent = await zero_copy.publish(self, live, cold, present is not None)
                self.counters["published"] += sum(1 for one in sent if one)

    def _live(self, entries: list) -> list:
        """Those of ``entries`` still ready in the host tier (the rest were evicted while
        queued)."""
        live = [e for e in entries if self.host.entries.get(e.key) is e and e.ready]
        self.counters["publish_lost"] += len(entries) - len(live)
        return live

    async def _publish_bytes(self, entry, cold: bool, checked: bool) -> None:
        async with self.pack_slots:  # packed values in memory: at most twice the puts
            if not self._live([entry]):
                return
            value = await self._pack(entry, cold)
            async with self.put_slots:  # the next value packs while this one is sent
                sent = await self.remote.put(entry.ns, entry.key, value, checked=checked)
            if sent is not None:  # finished: nothing reads the buffer any more
                self.buffers.give(value.obj)
            if sent:
                self.counters["published"] += 1

    async def _pack(self, entry, cold: bool) -> memoryview:
        """The entry's value, packed on a CPU thread into a reused buffer while the entry
        is pinned."""
        self.host.pin([entry])
        pinned_at = self.host.clock
        buf = self.buffers.take(value_bytes(entry.size, self.seal))
        try:
            return await self.remote.cpu(pack, entry.ns, entry.key,
                                         self.view[entry.offset:entry.offset + entry.size],
                                         entry.shards, entry.shard_bytes, self.seal, buf)
        except BaseException:
            self.buffers.give(buf)  # ``cpu`` waited for the pack: nothing reads it
            raise
        finally:  # a demoted entry nobody used meanwhile goes back to the cold end
            self.host.unpin([entry], cold_since=pinned_at if cold else None)

    # ---- promotion -----------------------------------------------------------------

    async def lookup(self, scope, keys: list) -> int:
        """How many of ``keys`` (in order) the store holds under the namespace of ``scope``
        (kvd/tiers/scope.py); starts fetching them."""
        n = await self.remote.exists_prefix(scope.ns, keys)
        self._start_fetches(scope, keys[:n])
        return n

    def _start_fetches(self, scope, keys: list) -> None:
        """Promotions of ``keys``. Zero-copy: runs of chunks a store call
        (kvd/tiers/remote/zero_copy.py). Else values of at most half ``BATCH_BYTES`` are
        fetched ``BATCH_BYTES`` at a time in one round trip (the store's ``get_many``, one
        fetch slot), larger ones one a call (no round trip to save, and a batch would delay
        its first chunk)."""
        expect = scope.shard_bytes or self.shard_bytes.get(scope.ns, 0)
        todo = [k for k in keys if k not in self.promoting and k not in self.host.entries]
        if self.zero_copy and expect:
            per = zero_copy.batch_chunks(self, scope.shards * expect)
            for i in range(0, len(todo), per):
                futs = zero_copy.promote(self, scope.ns, todo[i:i + per], scope.shards, expect)
                for key, fut in futs.items():
                    self._promotion(scope, key, lambda f=fut: asyncio.shield(f))
        elif expect and hasattr(self.remote.store, "get_many") and \
                BATCH_BYTES // (scope.shards * expect) >= 2:
            per = BATCH_BYTES // (scope.shards * expect)
            for i in range(0, len(todo), per):
                part = todo[i:i + per]
                batch = asyncio.ensure_future(self._get_batch(scope.ns, part,
                                                              scope.shards * expect))
                for key in part:
                    self._promotion(scope, key, lambda k=key, b=batch: self._promote(
                        scope.ns, k, scope.shards, scope.shard_bytes, b))
        for key in keys:
            self._promotion(scope, key)

    async def _get_batch(self, ns: bytes, keys: list, expect: int) -> dict:
        async with self.fetch_slots:
            return dict(zip(keys, await self.remote.get_many(ns, keys, expect * len(keys))))

    async def promote_prefix(self, scope, keys: list) -> list:
        """Host entries, pinned, for the longest prefix of ``keys`` fetched from the store
        (or in the host tier already) as chunks ``scope`` may read."""
        futs = await self.fetches(scope, keys)
        # shielded: a cancelled load must not cancel fetches other requests wait for
        await asyncio.gather(*(asyncio.shield(f) for f in futs), return_exceptions=True)
        return hold_ready(self.host, keys[:len(futs)], scope)

    async def fetches(self, scope, keys: list) -> list:
        """The fetches (futures, True once the chunk is a ready host entry) of the longest
        prefix of ``keys`` that a lookup started, that the host tier holds, or that the store
        holds now (asked once); they land in any order, the caller awaits them in key order."""
        n, foreign = 0, False
        for key in keys:  # fetches a lookup started, or chunks they already brought
            entry = self.host.entries.get(key)
            if entry is not None and not scope.admits(entry):
                foreign = True  # another namespace's chunk ends the prefix here
                break
            if key not in self.promoting and (entry is None or not entry.ready):
                break
            n += 1
        if n < len(keys) and not foreign:
            n += await self.lookup(scope, keys[n:])
        return [self._promotion(scope, key) for key in keys[:n]]

    def _promotion(self, scope, key: bytes, fetch=None) -> asyncio.Future:
        """The promotion of ``key``: the one running, or a new one (``fetch()``, an
        awaitable; by default a fetch of this chunk alone)."""
        fut = self.promoting.get(key)
        if fut is None:
            fut = asyncio.ensure_future(
                fetch() if fetch is not None else
                self._promote(scope.ns, key, scope.shards, scope.shard_bytes, None))
            self.promoting[key] = fut
            fut.add_done_callback(lambda f, k=key: self.promoting.pop(k, None))
        return fut

    async def _promote(self, ns: bytes, key: bytes, shards: int, shard_bytes, batch) -> bool:
        entry = self.host.entries.get(key)
        if entry is not None:  # whose it is, the reader's ``hold_ready`` checks
            return entry.ready
        expect = shard_bytes or self.shard_bytes.get(ns, 0)  # the fetch's timeout grows with it
        if self.zero_copy and expect and batch is None:
            return await asyncio.shield(zero_copy.promote(self, ns, [key], shards, expect)[key])
        if batch is not None:  # shared by the batch's promotions
            value = (await asyncio.shield(batch)).get(key)
        else:
            async with self.fetch_slots:  # in key order: a load's first chunks come first
                value = await self.remote.get(ns, key, shards * expect)
        if value is None:
            self.counters["promotions_failed"] += 1
            return False
        try:
            head = parse(value, ns, key, self.seal)
            if head.shards != shards or (shard_bytes is not None and head.shard_bytes != shard_bytes):
                raise ChunkCorrupt(f"{head.shards} shards of {head.shard_bytes} bytes, this "
                                   f"namespace has {shards} of {shard_bytes}")
        except ChunkCorrupt as exc:
            return self._corrupt(ns, key, exc)
        self.shard_bytes[ns] = head.shard_bytes
        entry = self.host.entries.get(key)  # a store of this node may have made it meanwhile
        if entry is not None:
            return entry.ready
        entry, ranks = self._reserve(key, ns, head.shard_bytes, head.shards)
        if entry is None:
            return False
        ok = False
        try:
            await self.remote.cpu(copy_verified, value, head,
                                  self.view[entry.offset:entry.offset + entry.size], self.seal)
            ok = True
        except ChunkCorrupt as exc:
            self._corrupt(ns, key, exc)
        finally:
            for rank in ranks:
                (self.host.commit if ok else self.host.abort)(entry, rank)
        if ok:
            self.counters["promotions"] += 1
        return ok

    def _reserve(self, key: bytes, ns: bytes, shard_bytes: int, shards: int):
        """Every shard of a new host entry, or (None, []) (no room, a clashing entry)."""
        ranks, entry = [], None
        try:
            for rank in range(shards):
                entry, _ = self.host.reserve(key, ns, shard_bytes, shards, rank)
                ranks.append(rank)
        except ServerError as exc:
            for rank in ranks:
                self.host.abort(entry, rank)
            self.counters["promotions_failed"] += 1
            log.debug("remote promotion of %s skipped: %s", key.hex(), exc)
            return None, []
        return entry, ranks

    def _corrupt(self, ns: bytes, key: bytes, why: ChunkCorrupt) -> bool:
        self.counters["promotions_failed"] += 1
        self.remote.dropped_corrupt(ns, key, str(why))
        return False

    def stats(self) -> dict:
        c = self.counters
        return {**self.remote.stats(), "keyed": self.seal is not None, "publish": self.publish,
                "publish_queued": len(self.publishing), "published": c["published"],
                "publish_dropped": c["publish_dropped"], "publish_skipped": c["publish_skipped"],
                "publish_lost": c["publish_lost"], "promotions": c["promotions"],
                "promotions_failed": c["promotions_failed"], "load_pieces": c["load_pieces"],
                "promotions_running": len(self.promoting),
                **self.digests.stats()}
