"""Host tier: the index of cached chunks over the shared-memory arena.

Operations: ``reserve`` a shard of a chunk (dedup if that shard is already
stored or being written; otherwise allocate, evicting least-recently-used
entries), ``commit``/``abort`` the shard once its copy finished or failed,
``ready_prefix`` for lookups, ``pin``/``unpin`` for leases and in-flight
loads, ``clear``. Visibility: an entry is visible to lookups only when
every shard is stored (``ready``). Eviction: LRU order, skipping entries
that are pinned or have a shard being written (an entry the disk tier
also holds, ``on_disk``, loses only its host copy); "no space" raises
``NoSpace`` and never takes a slot that is in use. Capacity is the
arena's size and is never exceeded. Runs on the event loop only: no locks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvd.tiers.allocator import ExtentAllocator
from kvd_protocol.errors import BadRequest, NoSpace


@dataclass(eq=False)
class Entry:
    key: bytes
    ns: bytes
    offset: int
    shard_bytes: int
    shards: int
    stored: int = 0
    writing: int = 0
    refs: int = 0
    on_disk: bool = False  # a verified copy is on the disk tier (kvd.tiers.tiering)
    hits: int = 0          # lookups that found it (for disk_min_hits)
    passed_cold: bool = False  # a demotion pass skipped it for too few hits (counted once)
    created: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return self.shard_bytes * self.shards

    @property
    def ready(self) -> bool:
        return self.stored == (1 << self.shards) - 1

    def shard_offset(self, rank: int) -> int:
        return self.offset + rank * self.shard_bytes

    @property
    def evictable(self) -> bool:
        return self.refs == 0 and self.writing == 0


class HostTier:
    def __init__(self, capacity: int, align: int = 256):
        self.alloc = ExtentAllocator(capacity, align)
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.evictions = 0
        self.evicted_not_on_disk = 0
        self.dedup_hits = 0

    @property
    def capacity(self) -> int:
        return self.alloc.capacity

    def reserve(self, key: bytes, ns: bytes, shard_bytes: int, shards: int, rank: int):
        """(entry, True) when the caller must copy the shard in; (entry, False) on dedup."""
        entry = self.entries.get(key)
        bit = 1 << rank
        if entry is not None:
            if entry.ns != ns or entry.shard_bytes != shard_bytes or entry.shards != shards:
                raise BadRequest("key already cached with a different namespace or size")
            if (entry.stored | entry.writing) & bit:
                self.dedup_hits += 1
                return entry, False
            entry.writing |= bit
            return entry, True
        offset = self._allocate(shard_bytes * shards)
        entry = Entry(key, ns, offset, shard_bytes, shards, writing=bit)
        self.entries[key] = entry
        return entry, True

    def _allocate(self, size: int) -> int:
        if self.alloc.rounded(size) > self.capacity:
            raise NoSpace(f"a chunk of {size} bytes is larger than the host tier ({self.capacity} bytes)")
        offset = self.alloc.alloc(size)
        while offset is None:
            if not self._evict_one():
                raise NoSpace(f"host tier full: {size} bytes needed, everything else is in use")
            offset = self.alloc.alloc(size)
        return offset

    def _evict_one(self) -> bool:
        for entry in self.entries.values():
            if entry.evictable:
                self._drop(entry)
                self.evictions += 1
                self.evicted_not_on_disk += not entry.on_disk
                return True
        return False

    def _drop(self, entry: Entry) -> None:
        del self.entries[entry.key]
        self.alloc.free(entry.offset, entry.size)

    def commit(self, entry: Entry, rank: int) -> None:
        entry.writing &= ~(1 << rank)
        entry.stored |= 1 << rank
        self.entries.move_to_end(entry.key)

    def abort(self, entry: Entry, rank: int) -> None:
        entry.writing &= ~(1 << rank)
        if entry.stored == 0 and entry.writing == 0 and self.entries.get(entry.key) is entry:
            self._drop(entry)

    def ready_prefix(self, keys: list[bytes]) -> list[Entry]:
        """Ready entries for the longest prefix of ``keys``; marks them used."""
        out = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or not entry.ready:
                break
            self.entries.move_to_end(key)
            out.append(entry)
        return out

    def touch(self, entries) -> None:
        """Mark ``entries`` (present ones) most recently used."""
        for e in entries:
            if self.entries.get(e.key) is e:
                self.entries.move_to_end(e.key)

    @staticmethod
    def pin(entries) -> None:
        for e in entries:
            e.refs += 1

    @staticmethod
    def unpin(entries) -> None:
        for e in entries:
            e.refs -= 1

    def clear(self) -> tuple[int, int]:
        """Drop every evictable entry: (dropped, kept because in use)."""
        victims = [e for e in self.entries.values() if e.evictable]
        for e in victims:
            self._drop(e)
        return len(victims), len(self.entries)

    def stats(self) -> dict:
        ready = [e for e in self.entries.values() if e.ready]
        return {"capacity_bytes": self.capacity, "used_bytes": self.alloc.used,
                "chunks": len(ready), "entries": len(self.entries),
                "evictions": self.evictions, "evicted_not_on_disk": self.evicted_not_on_disk,
                "on_disk": sum(e.on_disk for e in ready), "dedup_hits": self.dedup_hits}
