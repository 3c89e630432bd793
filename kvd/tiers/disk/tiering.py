"""Policy between the host tier and the disk tier: demotion and promotion.

Runs on the event loop; the disk tier does the IO. Demotion: above ``high_watermark`` a
background task writes the coldest ready entries to disk, resuming its walk where it
stopped, pinning at most ``PINNED_SHARE`` at once; ``min_hits`` demotes only entries looked
up that often; ``flush`` writes every ready entry. Host eviction of an ``on_disk`` entry
keeps it findable on disk. Promotion: ``disk_prefix``/``promote_prefix`` continue a host
prefix from disk (a reservation committed only after verified bytes; failures are misses,
never wrong bytes), ending at another ``Scope``. Quotas: ``disk_max`` via kvd.tiers.host.quota.
After a warm restart, ``on_disk`` marks whose file is gone are cleared once recovery ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from kvd.tiers.disk.chunk_file import file_size
from kvd.tiers.disk.tier import DiskTier
from kvd.tiers.host.tier import HostTier
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
        self._task = self._reconciling = None
        self.on_demote = None  # callable(entry) for each demotion queued (remote_publish = demote)
        self.quota = host.quota  # kvd.tiers.host.quota.QuotaBook or None
        disk.on_evict = self._off_disk

    def start(self) -> None:
        self.disk.start()
        self._task = asyncio.ensure_future(self._demoter())
        self._reconciling = asyncio.ensure_future(self._reconcile())

    async def stop(self) -> None:
        for task in (self._task, self._reconciling):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*self.promoting.values(), return_exceptions=True)
        await self.disk.close()

    async def _reconcile(self) -> None:
        """Once the disk is scanned: clear ``on_disk`` of host entries it does not hold."""
        await self.disk.recovered()
        if self.disk.recovery["state"] != "done":
            return
        stale = [e for e in self.host.entries.values()
                 if e.on_disk and self.disk.get(e.key, touch=False) is None]
        for e in stale:
            self.host.set_on_disk(e, False)
        if stale:
            log.info("disk tier: %d host chunks marked on disk are not there: unmarked", len(stale))

    def _off_disk(self, key: bytes) -> None:
        if self.quota is not None:
            self.quota.disk_forget(key)
        entry = self.host.entries.get(key)
        if entry is not None:
            self.host.set_on_disk(entry, False)

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
        """Queue writes for the coldest entries; ``force``: every ready entry, cold or not
        (each key at most once per ``tried`` set). Returns how many were queued."""
        if force:
            return self._demote_all(tried)
        host, cap = self.host, self.host.capacity
        if host.alloc.used <= self.high * cap:
            return 0
        target = host.alloc.used - max(self.high - 0.1, 0.0) * cap
        queued = 0
        while host.scanned_bytes + self.demoting_bytes < target:
            entry = host.scan_next()
            if entry is None:
                break
            if entry.ready and not entry.on_disk and not entry.part and not self._cold(entry):
                state = self._submit(entry)
                if state == "full":
                    break  # queue full, no room, or pinned share reached: a later pass
                if state == "queued":
                    queued += 1
                    continue  # pinned: it left the evictable queue
            host.scan_mark(entry)
        return queued

    def _demote_all(self, tried: set | None) -> int:
        queued = 0
        for entry in list(self.host.entries.values()):  # an operator's flush: rare
            if not entry.ready or entry.on_disk or entry.part or entry.key in self.demoting:
                continue
            if tried is not None and entry.key in tried:
                continue
            state = self._submit(entry)
            if state == "full":
                break
            if tried is not None:
                tried.add(entry.key)
            queued += state == "queued"
        return queued

    def _cold(self, entry) -> bool:
        """Too few hits to demote (``min_hits``); counted once per entry."""
        if entry.hits >= self.min_hits:
            return False
        if not entry.passed_cold:
            entry.passed_cold = True
            self.counters["demotions_skipped_cold"] += 1
        return True

    def _submit(self, entry) -> str:
        """Queue a disk write of ``entry``: "queued", "on_disk" (already there), "full", or
        "over_quota" (its quota groups' disk_max)."""
        cap = self.host.capacity
        if self.demoting and self.demoting_bytes + entry.size > PINNED_SHARE * cap:
            return "full"  # pinned for demotion: bounded, so stores still find room
        counted = self.quota is not None and entry.key not in self.disk.entries
        if counted and not self.quota.disk_admit(entry, file_size(entry.size), self._quota_delete):
            return "over_quota"
        payload = self.view[entry.offset:entry.offset + entry.size]
        fut = self.disk.submit_write(entry.ns, entry.key, payload, entry.shards,
                                     entry.shard_bytes)
        if fut is None:
            if counted:  # not written after all
                self.quota.disk_forget(entry.key, dropped=False)
            if entry.key in self.disk.entries:
                self.host.set_on_disk(entry, True)
                return "on_disk"
            return "full"
        self.host.pin([entry])
        if self.on_demote is not None:
            self.on_demote(entry)
        self.demoting.add(entry.key)
        self.demoting_bytes += entry.size
        pinned_at = self.host.clock
        fut.add_done_callback(lambda f, e=entry: self._demoted(e, f, pinned_at))
        return "queued"

    def _quota_delete(self, key: bytes) -> bool:
        """Delete ``key``'s file for its quota group's ``disk_max``: only a disk-only chunk."""
        return key not in self.host.entries and self.disk.evict(key)

    def _demoted(self, entry, fut: asyncio.Future, pinned_at: int) -> None:
        self.demoting.discard(entry.key)
        self.demoting_bytes -= entry.size
        if not fut.cancelled() and fut.exception() is None and fut.result():
            self.host.set_on_disk(entry, True)
            self.counters["demotions"] += 1
            self.host.unpin([entry], cold_since=pinned_at)  # back where it was, unless used
        else:
            if self.quota is not None:
                self.quota.disk_forget(entry.key, dropped=False)
            self.host.unpin([entry])

    async def flush(self) -> int:
        """Queue every ready host entry not yet on disk (``min_hits`` aside), then wait for
        the queue to empty."""
        waited, tried = 0, set()
        while True:  # several passes when the queue is shorter than the host tier
            queued = self.demote_pass(force=True, tried=tried)
            waited += await self.disk.flush()
            if queued == 0:
                return waited

    # ---- promotion -----------------------------------------------------------------

    def disk_prefix(self, keys: list, scope, promote: bool = True) -> int:
        """How many of ``keys`` (in order) are on disk as chunks ``scope`` may read; starts
        promoting them (``promote``)."""
        n = 0
        for key in keys:
            d = self.disk.get(key)
            if d is None or not scope.admits(d):
                break
            if promote:
                self._promotion(key)
            n += 1
        return n

    async def promote_prefix(self, keys: list, scope) -> list:
        """Host entries, pinned, for the longest prefix of ``keys`` found on disk (or in the
        host tier already) as chunks ``scope`` may read."""
        futs = []
        for key in keys:
            held = self.host.entries.get(key)
            found = self.disk.get(key) if held is None else held
            if found is None or not scope.admits(found):
                break
            futs.append(self._promotion(key))
        # shielded: a cancelled load must not cancel promotions other requests wait for
        await asyncio.gather(*(asyncio.shield(f) for f in futs), return_exceptions=True)
        return hold_ready(self.host, keys[:len(futs)], scope)

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
        ranks, acct = [], 0 if self.quota is None else self.quota.disk_account(key)
        try:
            for rank in range(d.shards):
                entry, _ = self.host.reserve(key, d.ns, d.shard_bytes, d.shards, rank, acct)
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
            self.host.set_on_disk(entry, True)
            self.counters["promotions"] += 1
            if self.quota is not None:
                self.quota.disk_touch(key)
        else:
            self.counters["promotions_failed"] += 1
        return ok

    def stats(self) -> dict:
        c = self.counters
        return {"demotions": c["demotions"], "promotions": c["promotions"],
                "promotions_failed": c["promotions_failed"],
                "demotions_skipped_cold": c["demotions_skipped_cold"],
                "demotions_queued": len(self.demoting)}


def hold_ready(host: HostTier, keys, scope) -> list:
    """The host entries of ``keys`` up to the first that is not ready or not ``scope``'s,
    used and pinned: what a load copies from once promotions (disk, remote) have landed."""
    out = host.ready_prefix(keys, scope)
    host.pin(out)
    return out
