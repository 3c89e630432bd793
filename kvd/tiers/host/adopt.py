"""Adopting an arena a previous daemon left: rebuild the host tier from its index, verify.

``rebuild(index, capacity, align, crashed)`` turns ``LIVE`` records (kvd.tiers.host.arena_index)
into host entries, one per key; a record that cannot be right (rank, shards, alignment,
bounds), disagrees with its key's others, or overlaps another entry is dropped and counted
(``bad_records``), so what remains can be adopted as is. After a clean stop every shard is
trusted; after a crash shards with a checksum are ``unverified`` (no hits) until ``verify``
checked them, most recently used first, at most ``VERIFY_INFLIGHT`` bytes queued; a
mismatch is dropped (``checksum_failures``). Shards without a checksum get one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from kvd.tiers.host.arena_index import ON_DISK, SEALED, ArenaIndex
from kvd.tiers.host.tier import Entry, HostTier
from kvd_protocol.limits import MAX_TP_SIZE

log = logging.getLogger("kvd")
VERIFY_INFLIGHT = 256 * 2**20
LOG_FAILURES = 10  # checksum failures logged one by one; the rest are counted


@dataclass
class Adoption:
    crashed: bool
    entries: list = field(default_factory=list)
    live: dict = field(default_factory=dict)       # record number -> entry
    checks: list = field(default_factory=list)     # (entry, rank, digest) to verify
    unsealed: list = field(default_factory=list)   # (record number, offset, size) to seal
    bad_records: int = 0

    @property
    def bytes(self) -> int:
        return sum(e.slot_bytes for e in self.entries)


def rebuild(index: ArenaIndex, capacity: int, align: int, crashed: bool) -> Adoption:
    numbers, recs = index.live_records()
    out = Adoption(crashed)
    shards = recs["shards"].astype(np.int64)
    shard_bytes = recs["shard_bytes"].astype(np.int64)
    offsets = recs["offset"].astype(np.int64)
    sane = ((shards >= 1) & (shards <= MAX_TP_SIZE) & (recs["rank"] < shards)
            & (shard_bytes >= 1) & (shard_bytes <= capacity) & (offsets >= 0)
            & (offsets % align == 0) & (offsets < capacity))
    slots = -(-(shard_bytes * shards) // align) * align
    sane &= offsets + slots <= capacity
    picked = np.flatnonzero(sane)
    rows = zip(_column_bytes(recs["key"][picked]), _column_bytes(recs["ns"][picked]),
               *(column[picked].tolist() for column in (
                   numbers, recs["rank"], offsets, shard_bytes, shards, slots, recs["used"],
                   recs["hits"], recs["flags"], recs["digest"])))
    by_key: dict[bytes, Entry] = {}
    spoiled: set[bytes] = set()
    for key, ns, number, rank, offset, size, count, slot, used, hits, flags, digest in rows:
        e = by_key.get(key)
        if e is None:  # plain ints from tolist(): a numpy scalar per field costs 10x
            e = by_key[key] = Entry(key, ns, offset, size, count, slot, on_disk=True)
            e.recs = [-1] * count
        elif (e.ns != ns or e.offset != offset or e.shard_bytes != size or e.shards != count
              or e.recs[rank] >= 0):
            spoiled.add(key)
            continue
        e.recs[rank] = number
        if used > e.used:
            e.used = used
        if hits > e.hits:
            e.hits = hits
        if not flags & ON_DISK:
            e.on_disk = False
        if crashed and flags & SEALED:
            e.unverified |= 1 << rank
            out.checks.append((e, rank, digest))
        else:
            e.stored |= 1 << rank
            if not flags & SEALED:
                out.unsealed.append((number, offset + rank * size, size))
    for key in spoiled:
        del by_key[key]
    kept = _without_overlaps(sorted(by_key.values(), key=lambda e: e.offset))
    out.entries = kept
    out.live = {n: e for e in kept for n in e.recs if n >= 0}
    out.checks = [c for c in out.checks if out.live.get(c[0].recs[c[1]]) is c[0]]
    out.unsealed = [u for u in out.unsealed if u[0] in out.live]
    for number in numbers.tolist():
        if number not in out.live:
            index.set_state(number, False)
            out.bad_records += 1
    return out


def _column_bytes(column: np.ndarray) -> list[bytes]:
    """The raw bytes of each element of a fixed-size void column (NULs kept)."""
    raw = np.ascontiguousarray(column).tobytes()
    width = column.dtype.itemsize
    return [raw[i:i + width] for i in range(0, len(raw), width)]


def _without_overlaps(entries: list) -> list:
    """``entries`` (sorted by offset) less every one whose extent overlaps another's."""
    bad = set()
    end, last = 0, None
    for e in entries:
        if last is not None and e.offset < end:
            bad.update((id(e), id(last)))
        if e.offset + e.slot_bytes > end:
            end, last = e.offset + e.slot_bytes, e
    return [e for e in entries if id(e) not in bad]


async def verify(tier: HostTier, journal, checks: list, progress=None) -> None:
    """Check the digest of every shard in ``checks``, most recently used first; counts go
    to ``journal.counters`` (verified_shards, checksum_failures, verify_skipped)."""
    c = journal.counters
    c["verify_pending"] = len(checks)
    t0 = time.monotonic()
    inflight = 0
    wake = asyncio.Event()

    def done(payload, digests: np.ndarray, _hashed) -> None:
        nonlocal inflight
        e, rank, expected = payload
        digest = int(digests[0])
        inflight -= e.shard_bytes
        c["verify_pending"] -= 1
        result = tier.verified(e, rank, digest == expected)
        if result is None:
            c["verify_skipped"] += 1  # evicted (or cleared) before its turn
        elif result:
            c["verified_shards"] += 1
        else:
            c["checksum_failures"] += 1
            if c["checksum_failures"] <= LOG_FAILURES:
                log.warning("host tier: chunk %s (shard %d at offset %d) failed its checksum "
                            "after the crash: dropped", e.key.hex(), rank, e.shard_offset(rank))
        wake.set()

    for e, rank, expected in sorted(checks, key=lambda c: -c[0].used):
        if tier.entries.get(e.key) is not e or not e.unverified & (1 << rank):
            c["verify_pending"] -= 1
            c["verify_skipped"] += 1
            continue
        while inflight >= VERIFY_INFLIGHT:
            wake.clear()
            await wake.wait()
        inflight += e.shard_bytes
        journal.hasher.submit(done, (e, rank, expected), [e.shard_offset(rank)], [e.shard_bytes])
        if progress is not None:
            progress(len(checks) - c["verify_pending"])
    while c["verify_pending"] > 0:
        wake.clear()
        await wake.wait()
    c["verify_seconds"] = round(time.monotonic() - t0, 3)
