"""One cached chunk of the host tier: where its shards live and what holds them.

An ``Entry`` is the host tier's record of a key (kvd/tiers/host/tier.py owns every field's
changes): its arena slot (``offset``, ``slot_bytes``), one bit per TP shard in ``stored``,
``writing`` (a store copying it in), ``unverified`` (adopted after a crash) and the pins
(``refs``) that keep it from eviction. ``ready`` (visible to lookups) once every shard is
stored, ``evictable`` with no pin and no shard being written. It carries its LRU links
(kvd/tiers/host/lru.py), index records (kvd/tiers/host/journal.py) and quota account (``acct``). A
partial entry (``part`` tokens: docs/protocol.md §8.5) lives in the host tier only: never
demoted, published or journaled.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Entry:
    key: bytes
    ns: bytes
    offset: int
    shard_bytes: int
    shards: int
    slot_bytes: int = 0    # the arena bytes it holds (size rounded to the alignment)
    acct: int = 0          # the quota account its bytes count in (kvd/tiers/host/quota.py)
    stored: int = 0
    writing: int = 0
    refs: int = 0
    on_disk: bool = False  # a verified copy is on the disk tier (set with HostTier.set_on_disk)
    hits: int = 0          # lookups that found it (for disk_min_hits)
    passed_cold: bool = False  # a demotion pass skipped it for too few hits (counted once)
    used: int = 0          # the tier's use clock at its last use
    scan: int = 0          # the demotion scan generation that examined it
    scan_bytes: int = 0    # what it added to ``scanned_bytes`` then
    unverified: int = 0    # shards adopted after a crash whose checksum is not checked yet
    part: int = 0          # a partial entry's tokens (fewer than a chunk's; host only); 0: a chunk
    recs: list | None = field(default=None, repr=False)  # index record of each shard (journal)
    lru_prev: object = field(default=None, repr=False)
    lru_next: object = field(default=None, repr=False)

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
