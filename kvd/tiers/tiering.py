"""Policy between the host tier and the disk tier: demotion and promotion.

Runs on the event loop; the disk tier does the IO on its threads.

- **Demotion by watermark**: when the host tier's used bytes exceed
  ``high_watermark`` × capacity, a background task walks host entries from
  least recently used and queues a disk write for each ready entry not yet
  on disk, until the coldest ``used - (high_watermark - 0.1) × capacity``
  bytes are on disk or queued. The entry stays pinned while its bytes are
  read on an IO thread, so its slot cannot be reused mid-copy (at most
  ``PINNED_SHARE`` of the host tier, or one entry, is pinned so at once);
  on success it is marked ``on_disk``. Each store wakes the demoter. Host eviction then drops only the host copy (the
  chunk stays findable on disk); entries evicted before reaching disk are
  lost and counted by the host tier. ``min_hits`` > 0 demotes only entries
  looked up at least that often (Dynamo's "second hit" rule).
- **Promotion**: ``disk_prefix`` continues a lookup's host prefix with keys
  found on disk and starts their promotion (disk → a fresh host slot);
  ``promote_prefix`` (load) waits for those promotions and returns the
  ready host entries, pinned. A promotion reserves every shard of the host
  entry (invisible until the verified bytes are in), reads on an IO thread,
  then commits; any failure aborts the reservation: a miss, never wrong bytes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from kvd.tiers.disk import DiskTier
from kvd.tiers.host import HostTier
from kvd_protocol.errors import ServerError

log = logging.getLogger("kvd")
DEMOTE_PERIOD_S = 0.05
PINNED_SHARE = 0.1  # most of the host tier that demotions in flight may pin


class Tiering:
    def __init__(self, host: HostTier, disk: DiskTier, view, high_watermark: float = 0.9,
                 min_hits: int = 0):
        self.host = host
        self.disk = disk
        self.view = view  # the arena's bytes (numpy uint8)
        self.high = high_watermark
        self.min_hits = min_hits
        self.demoting: set[bytes] = set()
        self.demoting_bytes = 0
        self.promoting: dict[bytes, asyncio.Future] = {}
        self.counters: Counter = Counter()
        self.wake = asyncio.Event()
        self._task = None
        disk.on_evict = self._off_disk

    def start(self) -> None:
        self.disk.start()
        self._task = asyncio.ensure_future(self._demoter())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self.promoting.values(), return_exceptions=True)
        await self.disk.close()

    def _off_disk(self, key: bytes) -> None:
        entry = self.host.entries.get(key)
        if entry is not None:
            entry.on_disk = False

    # ---- demotion ------------------------------------------------------------------

    async def _demoter(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), DEMOTE_PERIOD_S)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            try:
                self.demote_pass()
            except Exception:  # a bug must not stop demotion for good
                log.exception("demotion pass failed")

    def demote_pass(self, force: bool = False, tried: set | None = None) -> int:
        """Queue writes for the coldest entries; ``force``: every ready entry (each key at
        most once per ``tried`` set). Returns how many were queued."""
        cap, used = self.host.capacity, self.host.alloc.used
        if not force and used <= self.high * cap:
            return 0
        target = used if force else used - max(self.high - 0.1, 0.0) * cap
        covered = queued = 0
        for entry in list(self.host.entries.values()):
            if covered >= target:
                break
            if not entry.ready:
                continue
            covered += entry.size
            if entry.on_disk or entry.key in self.demoting:
                continue
            if tried is not None and entry.key in tried:
                continue
            if entry.hits < self.min_hits:
                if not entry.passed_cold:
                    entry.passed_cold = True
                    self.counters["demotions_skipped_cold"] += 1
                continue
            if self.demoting and self.demoting_bytes + entry.size > PINNED_SHARE * cap:
                break  # pinned for demotion: bounded, so stores still find room
            payload = self.view[entry.offset:entry.offset + entry.size]
            fut = self.disk.submit_write(entry.ns, entry.key, payload, entry.shards,
                                         entry.shard_bytes)
            if fut is None:
                if entry.key in self.disk.entries:
                    entry.on_disk = True
                    continue
                break  # queue full or no room: try again on a later pass
            if tried is not None:
                tried.add(entry.key)
            self.host.pin([entry])
            self.demoting.add(entry.key)
            self.demoting_bytes += entry.size
            fut.add_done_callback(lambda f, e=entry: self._demoted(e, f))
            queued += 1
        return queued

    def _demoted(self, entry, fut: asyncio.Future) -> None:
        self.host.unpin([entry])
        self.demoting.discard(entry.key)
        self.demoting_bytes -= entry.size
        if not fut.cancelled() and fut.exception() is None and fut.result():
            entry.on_disk = True
            self.counters["demotions"] += 1

    async def flush(self) -> int:
        """Queue every ready host entry not yet on disk, then wait for the queue to empty."""
        waited, tried = 0, set()
        while True:  # several passes when the queue is shorter than the host tier
            queued = self.demote_pass(force=True, tried=tried)
            waited += await self.disk.flush()
            if queued == 0:
                return waited

    # ---- promotion -----------------------------------------------------------------

    def disk_prefix(self, keys: list, promote: bool = True) -> int:
        """How many of ``keys`` (in order) are on disk; starts promoting them (``promote``)."""
        n = 0
        for key in keys:
            if self.disk.get(key) is None:
                break
            if promote:
                self._promotion(key)
            n += 1
        return n

    async def promote_prefix(self, keys: list) -> list:
        """Host entries, pinned, for the longest prefix of ``keys`` found on disk."""
        futs = []
        for key in keys:
            if self.host.entries.get(key) is None and self.disk.get(key) is None:
                break
            futs.append(self._promotion(key))
        # shielded: a cancelled load must not cancel promotions other requests wait for
        await asyncio.gather(*(asyncio.shield(f) for f in futs), return_exceptions=True)
        out = []
        for key in keys[:len(futs)]:
            entry = self.host.entries.get(key)
            if entry is None or not entry.ready:
                break
            out.append(entry)
        self.host.pin(out)
        self.host.touch(out)
        return out

    def _promotion(self, key: bytes) -> asyncio.Future:
        fut = self.promoting.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._promote(key))
            self.promoting[key] = fut
            fut.add_done_callback(lambda f, k=key: self.promoting.pop(k, None))
        return fut

    async def _promote(self, key: bytes) -> bool:
        entry = self.host.entries.get(key)
        if entry is not None:
            return entry.ready
        d = self.disk.get(key)
        if d is None:
            return False
        ranks = []
        try:
            for rank in range(d.shards):
                entry, _ = self.host.reserve(key, d.ns, d.shard_bytes, d.shards, rank)
                ranks.append(rank)
        except ServerError as exc:  # no room (everything pinned) or a clashing entry
            for rank in ranks:
                self.host.abort(entry, rank)
            self.counters["promotions_failed"] += 1
            log.debug("promotion of %s skipped: %s", key.hex(), exc)
            return False
        ok = False
        try:
            ok = await self.disk.read_into(d, self.view[entry.offset:entry.offset + entry.size])
        finally:
            for rank in ranks:
                (self.host.commit if ok else self.host.abort)(entry, rank)
        if ok:
            entry.on_disk = True
            self.counters["promotions"] += 1
        else:
            self.counters["promotions_failed"] += 1
        return ok

    def stats(self) -> dict:
        c = self.counters
        return {"demotions": c["demotions"], "promotions": c["promotions"],
                "promotions_failed": c["promotions_failed"],
                "demotions_skipped_cold": c["demotions_skipped_cold"],
                "demotions_queued": len(self.demoting)}
