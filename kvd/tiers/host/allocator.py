"""Extent allocator over a fixed byte range (the host arena).

``alloc(size)`` returns an ``align``-ed offset or None (the caller evicts and retries);
``free`` merges an extent with its free neighbours; ``claim(start, size)`` takes back one
exact free extent (undoing evictions; a scan, for that rare path only); ``around`` starts
with given extents in use (adoption). Exact-size free lists make one-chunk-size daemons
O(1). Never hands out a byte twice, never exceeds capacity.
"""

from __future__ import annotations


class ExtentAllocator:
    def __init__(self, capacity: int, align: int = 256):
        self.align = align
        self.capacity = capacity - capacity % align
        self.used = 0
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._by_size: dict[int, set[int]] = {}
        if self.capacity:
            self._add(0, self.capacity)

    @classmethod
    def around(cls, capacity: int, align: int, used) -> "ExtentAllocator":
        """An allocator whose ``used`` extents ((start, size) pairs, sizes rounded to
        ``align``, not overlapping) are taken and everything between them is free."""
        a = cls(0, align)
        a.capacity = capacity - capacity % align
        at = 0
        for start, size in sorted(used):
            size = a.rounded(max(size, 1))
            if start < at or start % align or start + size > a.capacity:
                raise ValueError(f"extent [{start}, {start + size}) overlaps another, is not "
                                 "aligned or lies past the capacity")
            if start > at:
                a._add(at, start - at)
            a.used += size
            at = start + size
        if at < a.capacity:
            a._add(at, a.capacity - at)
        return a

    def rounded(self, size: int) -> int:
        return -(-size // self.align) * self.align

    def _add(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        self._by_size.setdefault(size, set()).add(start)

    def _remove(self, start: int) -> int:
        size = self._by_start.pop(start)
        del self._by_end[start + size]
        starts = self._by_size[size]
        starts.discard(start)
        if not starts:
            del self._by_size[size]
        return size

    def alloc(self, size: int) -> int | None:
        size = -(-max(size, 1) // self.align) * self.align  # rounded(), inlined: a hot path
        by_size = self._by_size
        fit = size if size in by_size else min((s for s in by_size if s > size), default=None)
        if fit is None:
            return None
        starts = by_size[fit]
        start = starts.pop()
        if not starts:
            del by_size[fit]
        del self._by_start[start]
        del self._by_end[start + fit]
        if fit > size:
            self._add(start + size, fit - size)
        self.used += size
        return start

    def free(self, start: int, size: int) -> None:
        size = self.rounded(max(size, 1))
        self.used -= size
        end = start + size
        if end in self._by_start:
            size += self._remove(end)
        if start in self._by_end:
            prev = self._by_end[start]
            size += self._remove(prev)
            start = prev
        self._add(start, size)

    def claim(self, start: int, size: int) -> None:
        """Allocate exactly ``[start, start + rounded(size))``, which must be free."""
        size = self.rounded(max(size, 1))
        hole = next((s for s, n in self._by_start.items() if s <= start and start + size <= s + n),
                    None)
        if hole is None:
            raise ValueError(f"extent [{start}, {start + size}) is not free")
        hole_size = self._remove(hole)
        if start > hole:
            self._add(hole, start - hole)
        if hole + hole_size > start + size:
            self._add(start + size, hole + hole_size - start - size)
        self.used += size

    def largest_free(self) -> int:
        return max(self._by_size, default=0)
