"""The host tier's eviction: its LRU queue of evictable entries, room, and the demotion scan.

``HostEviction`` holds the index and counters and chooses or undoes evictions; ``HostTier``
(kvd/tiers/host/tier.py) builds reservations, commits, lookups and pins on it. Only
evictable entries (no pin, no shard being written) sit in the LRU queue (host/lru.py), so
eviction never walks past entries in use; a use moves an entry to the MRU end, a
demotion's pin puts it back at the LRU end. Quotas (host/quota.py) pick victims per
account. No space: ``NoSpace`` before evicting anything when free + evictable bytes fall
short, and every eviction undone (same offsets and order) when fragmentation still leaves
no hole; a slot in use is never taken, capacity never exceeded. ``scan_next``/``scan_mark``
let demotion passes (disk/tiering.py) resume where the last stopped. Event loop only.
"""

from __future__ import annotations

from kvd.tiers.host.allocator import ExtentAllocator
from kvd.tiers.host.entry import Entry
from kvd.tiers.host.lru import LruQueue
from kvd_protocol.errors import NoSpace


class HostEviction:
    def __init__(self, capacity: int, align: int = 256, quota=None):
        self.alloc = ExtentAllocator(capacity, align)
        self.quota = quota  # kvd.tiers.host.quota.QuotaBook, or None: no quotas
        self.entries: dict[bytes, Entry] = {} if quota is None else quota.index()
        self.lru = LruQueue() if quota is None else quota.queue()  # evictable only, LRU first
        self.evictable_bytes = self.ready_count = self.on_disk_ready = self.clock = 0
        self.scan_gen, self.scan_last, self.scanned_bytes = 1, None, 0
        self.cold_tail = None  # the last entry queued cold: the front run they form ends there
        self.evictions = self.evicted_not_on_disk = self.dedup_hits = 0
        self.journal = None  # kvd.tiers.host.journal.Journal: keeps the arena's index file

    @property
    def capacity(self) -> int:
        return self.alloc.capacity

    # ---- the evictable queue ----------------------------------------------------------

    def _enqueue(self, e: Entry, where: str = "mru") -> None:
        """Queue ``e`` at the most recently used end ("mru"), at the very front ("front"),
        or into the front run of entries that came back cold, in order of last use
        ("cold"; writes finish about in the order they were queued, so the walk back from
        the run's end is short)."""
        if where == "mru":
            self.lru.append(e)
        else:
            anchor = self.cold_tail if where == "cold" else None
            while anchor is not None and anchor.used > e.used:
                anchor = self.lru.before(anchor)
            if anchor is None:
                self.lru.appendleft(e)
                inside = self.scan_last is not None
            else:
                self.lru.insert_after(e, anchor)
                inside = anchor.scan == self.scan_gen
                if anchor is self.scan_last:
                    self.scan_last = e
            if inside:  # within the examined prefix: counted as examined
                self._count_scanned(e)
            if where == "cold" and (anchor is self.cold_tail or self.cold_tail is None):
                self.cold_tail = e
        self.evictable_bytes += e.slot_bytes

    def _dequeue(self, e: Entry) -> None:
        self._leave_front(e)
        self.lru.remove(e)
        self.evictable_bytes -= e.slot_bytes

    def _leave_front(self, e: Entry) -> None:
        """``e`` leaves its place: the examined prefix and the cold run end before it."""
        if e is self.scan_last:
            self.scan_last = self.lru.before(e)
        if e is self.cold_tail:
            self.cold_tail = self.lru.before(e)
        if e.scan == self.scan_gen:
            self.scanned_bytes -= e.scan_bytes
            e.scan = 0

    def _settle(self, e: Entry) -> None:
        """Queue ``e`` (most recently used end) when it became evictable."""
        if e.evictable and not self.lru.queued(e):
            self._enqueue(e)

    def _use(self, e: Entry) -> None:
        self.clock += 1
        e.used = self.clock
        if e.lru_next is not None:  # queued: to the most recently used end
            self._leave_front(e)
            self.lru.move_to_end(e)

    def _check_room(self, count: int, slot: int, held: int, acct: int) -> None:
        if not count:
            return
        if slot > self.capacity:
            raise NoSpace(f"a chunk of {slot} bytes is larger than the host tier "
                          f"({self.capacity} bytes)")
        room = self.capacity - self.alloc.used + self.evictable_bytes - held - self.lru.reserved_bytes(acct)
        if count * slot > room:
            raise NoSpace(f"host tier full: {count * slot} bytes needed, {room} free or "
                          "evictable, everything else is in use (or reserved by quotas)")

    def _allocate(self, count: int, slot: int, acct: int = 0) -> list[int]:
        """Offsets of ``count`` slots for ``acct``, evicting the queue's victims (the LRU end; a
        victim of the same slot size hands its slot straight over); all or nothing."""
        offsets, evicted, full = [], [], False  # full: no free extent fits (until one is freed)
        lru, alloc, victims = self.lru, self.alloc, self.lru.victims(acct)
        try:
            for victim in lru.cap_victims(acct, count * slot) if count else ():
                same = victim.slot_bytes == slot and len(offsets) < count  # hands its slot over
                self._evict(victim, not same, evicted)
                offsets.extend([victim.offset] if same else [])
            for _ in range(count - len(offsets)):
                offset = None if full else alloc.alloc(slot)
                while offset is None:
                    victim = next(victims)
                    if victim is None:
                        raise NoSpace(f"host tier full: no free extent of {slot} bytes even "
                                      "after evicting everything evictable (fragmented)")
                    same = victim.slot_bytes == slot
                    self._evict(victim, not same, evicted)
                    offset = victim.offset if same else alloc.alloc(slot)
                    full = same
                offsets.append(offset)
        except NoSpace:
            for offset in offsets:
                self.alloc.free(offset, slot)
            self._unevict(evicted)
            raise
        return offsets

    def _evict(self, e: Entry, free: bool, evicted: list) -> None:
        self._drop(e, free)
        evicted.append(e)  # to be put back if the reservation fails after all
        self.evictions += 1
        self.evicted_not_on_disk += not e.on_disk

    def _unevict(self, evicted: list) -> None:
        """Put evicted entries back where they were: same bytes, same LRU order."""
        self.reset_scan()
        for e in reversed(evicted):
            self.alloc.claim(e.offset, e.slot_bytes)
            self.entries[e.key] = e
            self._count_ready(e, +1)
            self._enqueue(e, "front")
            if self.journal is not None:
                self.journal.restored(e)
            self.evictions -= 1
            self.evicted_not_on_disk -= not e.on_disk
            self.lru.evicted(e, -1)  # (counted by the queue as it chose them)

    def _drop(self, e: Entry, free: bool = True) -> None:
        """Forget ``e``; its slot goes back to the allocator unless ``free`` is False (the
        caller takes the slot over). Few calls: a store into a full tier evicts 100s."""
        if e.lru_next is not None:  # queued
            self._dequeue(e)
        del self.entries[e.key]
        if e.stored == (1 << e.shards) - 1:  # ready: _count_ready(e, -1)
            self.ready_count -= 1
            self.on_disk_ready -= e.on_disk
        if free:
            self.alloc.free(e.offset, e.slot_bytes)
        if self.journal is not None:
            self.journal.dropped(e)  # before the slot can be written again

    def _count_ready(self, e: Entry, sign: int) -> None:
        if e.ready:
            self.ready_count += sign
            self.on_disk_ready += sign * e.on_disk

    # ---- the demotion scan ------------------------------------------------------------

    def scan_next(self) -> Entry | None:
        """The next queued entry (from the LRU end) the demotion scan has not examined."""
        return self.lru.first() if self.scan_last is None else self.lru.after(self.scan_last)

    def scan_mark(self, e: Entry) -> None:
        """Mark ``e`` (``scan_next()``) examined; its bytes count when it is ready."""
        self._count_scanned(e)
        self.scan_last = e

    def _count_scanned(self, e: Entry) -> None:
        e.scan = self.scan_gen
        e.scan_bytes = e.slot_bytes if e.ready else 0
        self.scanned_bytes += e.scan_bytes

    def reset_scan(self) -> None:
        self.scan_gen += 1
        self.scan_last, self.scanned_bytes = None, 0
