"""Host tier: the index of cached chunks over the shared-memory arena.

Operations: ``reserve_many`` the shards a store copies in (dedup where a
shard is already stored or being written; otherwise allocate, evicting
least-recently-used entries; all or nothing), ``reserve`` one shard (disk
promotions), ``commit``/``abort`` a shard once its copy finished or failed,
``ready_prefix`` for lookups, ``pin``/``unpin`` for leases, in-flight loads
and demotions, ``clear``. Visibility: an entry is visible to lookups only
when every shard is stored (``ready``), and only to readers of its own
namespace and shard geometry (a ``Scope``).

Eviction: only *evictable* entries (no pin, no shard being written) sit in
an LRU queue (kvd/tiers/host/lru.py: O(1) removal from the middle), so eviction
pops its head and never walks past entries in use. A use (a lookup or load
hit, a commit, a store that finds the key cached, ``touch``) moves an entry
to the most recently used end; an entry in use leaves the queue and, when
its last pin drops, re-enters at the most recently used end (a pin is a
use). The one exception is a demotion's pin: an entry the demoter copied to
disk and nobody used meanwhile re-enters at the least recently used end,
behind those that came back so before it (``unpin(..., cold_since=)``):
demotions take the coldest entries first, so this keeps their order. An entry the disk tier also
holds (``on_disk``) loses only its host copy. Quotas (kvd/tiers/host/quota.py): entries count in
their store's ``acct``; the book's index and queue stand in for the plain ones, pick victims.

No space: a reservation first counts the free and evictable bytes against
what it needs and raises ``NoSpace`` before evicting anything when they fall
short; when they suffice but fragmentation (chunks of several sizes) still
leaves no hole, every eviction it made is undone (same offsets, same LRU
order) before ``NoSpace`` is raised (the request's keys that were cached
count as used). A slot in use is never taken; capacity
is the arena's size and is never exceeded.

Demotion scan (kvd/tiers/disk/tiering.py): ``scan_next``/``scan_mark`` walk the
queue from its LRU end once; the queued prefix already examined and its
ready bytes (``scanned_bytes``) are kept up to date as entries come and go,
so a demotion pass resumes where the last one stopped instead of rescanning.

Warm restart: a ``journal`` (kvd/tiers/host/journal.py) hears of every shard
committed, entry dropped or put back and ``on_disk`` change, so the
arena's index file describes the committed shards. ``adopt`` starts from
the entries a previous daemon left; shards adopted after a crash stay
``unverified`` until checked (``verified``): no hits, a store of one is a
dedup (a miss at worst, never wrong bytes), a bad one is dropped (``drop_shard``).

``stats()`` reads counters kept up to date (O(1)). Runs on the event loop
only: no locks.
"""

from __future__ import annotations

from kvd.tiers.host.allocator import ExtentAllocator
from kvd.tiers.host.entry import Entry
from kvd.tiers.host.lru import LruQueue
from kvd_protocol.errors import BadRequest, NoSpace


class HostTier:
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

    # ---- reservations -----------------------------------------------------------------

    def reserve_many(self, keys: list, ns: bytes, shard_bytes: int, shards: int, rank: int, acct=0):
        """Reserve shard ``rank`` of every distinct key in quota account ``acct``, all or nothing:
        (todo, deduped) with todo the ``(index, entry)`` pairs the caller must copy in, in key
        order, and deduped ``len(keys) - len(todo)``. Raises ``NoSpace`` (``OverQuota``) or
        ``BadRequest`` (a key cached under another namespace or size) having changed nothing."""
        bit, seen = 1 << rank, set()
        fresh, joins, dedups = [], [], []
        for i, key in enumerate(keys):
            if key in seen:
                continue
            seen.add(key)
            entry = self.entries.get(key)
            if entry is None:
                fresh.append((i, key))
            elif entry.ns != ns or entry.shard_bytes != shard_bytes or entry.shards != shards:
                raise BadRequest("key already cached with a different namespace or size")
            elif (entry.stored | entry.writing | entry.unverified) & bit:
                dedups.append(entry)
            else:
                joins.append((i, entry))
        slot = self.alloc.rounded(shard_bytes * shards)
        held = [e for e in (*dedups, *(e for _, e in joins)) if self.lru.queued(e)]
        self._check_room(len(fresh), slot, sum(e.slot_bytes for e in held), acct)
        for e in held:  # neither a dedup hit nor an entry gaining a shard may be evicted now
            self._dequeue(e)
        try:
            offsets = self._allocate(len(fresh), slot, acct)
        except NoSpace:
            for e in held:
                self._enqueue(e)
            raise
        for e in dedups:
            self.dedup_hits += 1
            self._use(e)
            self._settle(e)
        todo = []
        for i, entry in joins:
            entry.writing |= bit
            todo.append((i, entry))
        for (i, key), offset in zip(fresh, offsets):
            entry = Entry(key, ns, offset, shard_bytes, shards, slot, acct, writing=bit)
            self.entries[key] = entry
            todo.append((i, entry))
        if joins:  # fresh keys alone are in key order already
            todo.sort(key=lambda item: item[0])
        return todo, len(keys) - len(todo)

    def reserve(self, key: bytes, ns: bytes, shard_bytes: int, shards: int, rank: int, acct=0):
        """(entry, True) when the caller must copy the shard in; (entry, False) on dedup."""
        todo, _ = self.reserve_many([key], ns, shard_bytes, shards, rank, acct)
        return (todo[0][1], True) if todo else (self.entries[key], False)

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

    def commit(self, entry: Entry, rank: int) -> None:
        self.commit_many([entry], rank)

    def commit_many(self, entries: list, rank: int) -> None:
        """Shard ``rank`` of each of ``entries`` landed: stored, most recently used, and
        recorded by the journal in one batch (a request's chunks commit together)."""
        bit, recorded, lru, live = 1 << rank, [], self.lru, self.entries
        for e in entries:  # _count_ready, _use and _settle inlined: a request commits 100s
            full = (1 << e.shards) - 1
            was_ready = e.stored == full
            e.writing &= ~bit
            e.stored |= bit
            if not was_ready and e.stored == full:
                self.ready_count += 1
                self.on_disk_ready += e.on_disk
            self.clock += 1
            e.used = self.clock
            if e.lru_next is not None:  # queued: to the most recently used end
                self._leave_front(e)
                lru.move_to_end(e)
            elif e.refs == 0 and e.writing == 0:  # became evictable
                lru.append(e)
                self.evictable_bytes += e.slot_bytes
            if live.get(e.key) is e:
                recorded.append(e)
        if self.journal is not None and recorded:
            self.journal.committed_many(recorded, rank)

    def holds(self, e: Entry, rank: int) -> bool:
        """Shard ``rank`` of ``e`` is stored here now (not evicted, not replaced)."""
        return self.entries.get(e.key) is e and bool(e.stored >> rank & 1)

    def abort(self, entry: Entry, rank: int) -> None:
        entry.writing &= ~(1 << rank)
        if self.entries.get(entry.key) is not entry:
            return
        if entry.stored == 0 and entry.writing == 0 and entry.unverified == 0:
            self._drop(entry)
        else:
            self._settle(entry)

    # ---- lookups and pins -------------------------------------------------------------

    def ready_prefix(self, keys: list[bytes], scope) -> list[Entry]:
        """Ready entries for the longest prefix of ``keys`` that ``scope`` (kvd/tiers/scope.py)
        may read; marks them used."""
        out = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or not entry.ready or not scope.admits(entry):
                break
            self._use(entry)
            out.append(entry)
        return out

    def touch(self, entries) -> None:
        """Mark ``entries`` (present ones) most recently used."""
        for e in entries:
            if self.entries.get(e.key) is e:
                self._use(e)

    def pin(self, entries) -> None:
        for e in entries:
            e.refs += 1
            if self.lru.queued(e):
                self._dequeue(e)

    def unpin(self, entries, cold_since: int | None = None) -> None:
        """Drop a pin of each entry. With ``cold_since`` (the use clock when the pin was
        taken), an entry not used since goes back to the least recently used end."""
        for e in entries:
            e.refs -= 1
            if e.evictable and self.entries.get(e.key) is e:
                cold = cold_since is not None and e.used <= cold_since
                self._enqueue(e, "cold" if cold else "mru")

    def set_on_disk(self, e: Entry, on_disk: bool) -> None:
        if e.on_disk == on_disk:
            return
        e.on_disk = on_disk
        if e.ready and self.entries.get(e.key) is e:
            self.on_disk_ready += 1 if on_disk else -1
        if self.journal is not None and self.entries.get(e.key) is e:
            self.journal.flag_on_disk(e)
        if not on_disk and e.scan == self.scan_gen:
            self.reset_scan()  # examined as on disk, no longer is: examine again

    def clear(self) -> tuple[int, int]:
        """Drop every evictable entry: (dropped, kept because in use)."""
        victims = list(self.lru)
        for e in victims:
            self._drop(e)
        return len(victims), len(self.entries)

    # ---- warm restart -------------------------------------------------------------------

    def adopt(self, entries: list) -> None:
        """Start from ``entries`` a previous daemon left (offsets checked not to overlap),
        queued by their last use. Only on a tier that holds nothing yet."""
        if self.entries:
            raise ValueError("adopt needs an empty host tier")
        self.alloc = ExtentAllocator.around(self.capacity, self.alloc.align,
                                            [(e.offset, e.slot_bytes) for e in entries])
        for e in sorted(entries, key=lambda e: e.used):
            self.entries[e.key] = e
            self._count_ready(e, +1)
            self._enqueue(e)
            self.clock = max(self.clock, e.used)

    def verified(self, e: Entry, rank: int, ok: bool) -> bool | None:
        """Shard ``rank`` of adopted ``e`` was checked: ``ok`` stores it (a hit once every shard
        is), else ``drop_shard``; ``ok``, or None when ``e`` is gone or that shard was not waiting."""
        bit = 1 << rank
        if self.entries.get(e.key) is not e or not e.unverified & bit:
            return None
        e.unverified &= ~bit
        if not ok:
            self.drop_shard(e, rank)
            return False
        e.stored |= bit
        if e.ready:
            self._count_ready(e, +1)
            if e.scan == self.scan_gen:  # examined while not ready: examine it again
                self.reset_scan()
        return True

    def drop_shard(self, e: Entry, rank: int) -> None:
        """Shard ``rank`` of ``e`` failed its checksum: the entry goes, or the shard if in use."""
        self._count_ready(e, -1)
        e.stored &= ~(1 << rank)
        if self.lru.queued(e):
            self._drop(e)
        elif self.journal is not None:
            self.journal.dropped_shard(e, rank)

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

    def stats(self) -> dict:
        return {"capacity_bytes": self.capacity, "used_bytes": self.alloc.used,
                "chunks": self.ready_count, "entries": len(self.entries),
                "evictions": self.evictions, "evicted_not_on_disk": self.evicted_not_on_disk,
                "on_disk": self.on_disk_ready, "dedup_hits": self.dedup_hits,
                **({} if self.journal is None else {"warm": self.journal.stats()})}
