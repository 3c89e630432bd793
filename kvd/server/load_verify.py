"""``verify_loads = on``: a load's host chunks are checked against their checksums first.

By default a load trusts the host tier (the daemon's own memory). With ``on``,
``LoadVerifier.check(entries, rank)`` hashes each pinned shard on ``verify_threads`` and
compares with the checksum in the arena index (so it needs ``warm_restart``). The prefix
ends before the first mismatch: that shard is dropped (``host_corrupt_dropped``), later
ones unpinned, and the load answers with fewer chunks. A shard whose checksum is not
written yet is trusted and counted in ``host_verify_unsealed``.
"""

from __future__ import annotations

import asyncio
import logging

import xxhash

from kvd.tiers.daemon_threads import DaemonThreads

log = logging.getLogger("kvd")
LOG_DROPS = 10  # corrupt shards logged one by one; the rest are counted


class LoadVerifier:
    def __init__(self, tier, index, view, threads: int, stats):
        self.tier = tier
        self.index = index  # kvd.tiers.host.arena_index.ArenaIndex: the shards' checksums
        self.view = view  # the arena's bytes (uint8)
        self.stats = stats
        self.pool = DaemonThreads(threads, "kvd-verify")  # normal priority: a load waits on them

    async def check(self, entries: list, rank: int) -> list:
        """The longest prefix of pinned ``entries`` whose shard ``rank`` is intact; the
        rest are unpinned, the first bad one dropped from the tier."""
        expected = [self._sealed_digest(e, rank) for e in entries]
        futures = [self.pool.submit(self._hash, e.shard_offset(rank), e.shard_bytes)
                   if want is not None else None for e, want in zip(entries, expected)]
        digests = [None if f is None else await asyncio.wrap_future(f) for f in futures]
        self.stats.add("host_verify_unsealed", expected.count(None))
        good, bad = 0, None
        for e, want, got in zip(entries, expected, digests):
            if not self.tier.holds(e, rank):  # dropped by another load's check meanwhile
                break
            if want is not None and got != want:
                bad = e
                break
            good += 1
        self.tier.unpin(entries[good:])
        if bad is not None:  # unpinned first: unused elsewhere, its slot is freed at once
            self._drop(bad, rank)
        return entries[:good]

    def _sealed_digest(self, e, rank: int) -> int | None:
        number = -1 if e.recs is None else e.recs[rank]
        return None if number < 0 else self.index.sealed_digest(number)

    def _hash(self, offset: int, size: int) -> int:
        return xxhash.xxh3_64_intdigest(self.view[offset:offset + size])

    def _drop(self, e, rank: int) -> None:
        self.stats.add("host_corrupt_dropped")
        if self.stats.counters["host_corrupt_dropped"] <= LOG_DROPS:
            log.warning("host tier: chunk %s (shard %d at offset %d) failed its checksum on "
                        "load: dropped, the load ends before it", e.key.hex(), rank,
                        e.shard_offset(rank))
        self.tier.drop_shard(e, rank)

    def close(self) -> None:
        self.pool.close()
