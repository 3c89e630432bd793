"""Host tier: the index of cached chunks over the shared-memory arena.

Operations: ``reserve_many``/``reserve`` (dedup, allocate, evict LRU; all or nothing),
``commit``/``abort``, ``ready_prefix``, ``pin``/``unpin``, ``clear``. An entry is visible
only when every shard is stored, and only to its own namespace and shard geometry
(``Scope``). Only evictable entries sit in the LRU queue (kvd.tiers.host.lru), so eviction never
walks past entries in use; a demotion's pin re-enters cold. No space: ``NoSpace`` before
evicting anything when free + evictable bytes fall short, and evictions undone when
fragmentation still leaves no hole. A slot in use is never taken; capacity never exceeded.
A ``journal`` hears every change for warm restart; quotas (kvd.tiers.host.quota) pick victims.
Event loop only: no locks.
"""

from __future__ import annotations

from kvd.tiers.host.allocator import ExtentAllocator
from kvd.tiers.host.entry import Entry
from kvd.tiers.host.eviction import HostEviction
from kvd_protocol.errors import BadRequest, NoSpace


class HostTier(HostEviction):
    # ---- reservations -----------------------------------------------------------------

    def reserve_many(self, keys: list, ns: bytes, shard_bytes: int, shards: int, rank: int, acct=0, part=0):
        """Reserve shard ``rank`` of every distinct key in quota account ``acct`` (``part``: as
        partial entries of that many tokens), all or nothing: (todo, deduped) with todo the
        ``(index, entry)`` pairs to copy in, in key order, and deduped ``len(keys) - len(todo)``. Raises ``NoSpace`` (``OverQuota``) or
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
            elif (entry.ns, entry.shard_bytes, entry.shards, entry.part) != (ns, shard_bytes, shards, part):
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
            entry = Entry(key, ns, offset, shard_bytes, shards, slot, acct, writing=bit, part=part)
            self.entries[key] = entry
            todo.append((i, entry))
        if joins:  # fresh keys alone are in key order already
            todo.sort(key=lambda item: item[0])
        return todo, len(keys) - len(todo)

    def reserve(self, key: bytes, ns: bytes, shard_bytes: int, shards: int, rank: int, acct=0):
        """(entry, True) when the caller must copy the shard in; (entry, False) on dedup."""
        todo, _ = self.reserve_many([key], ns, shard_bytes, shards, rank, acct)
        return (todo[0][1], True) if todo else (self.entries[key], False)

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
            if live.get(e.key) is e and not e.part:  # partial entries: not kept across restarts
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


    def stats(self) -> dict:
        return {"capacity_bytes": self.capacity, "used_bytes": self.alloc.used,
                "chunks": self.ready_count, "entries": len(self.entries),
                "evictions": self.evictions, "evicted_not_on_disk": self.evicted_not_on_disk,
                "on_disk": self.on_disk_ready, "dedup_hits": self.dedup_hits,
                **({} if self.journal is None else {"warm": self.journal.stats()})}
