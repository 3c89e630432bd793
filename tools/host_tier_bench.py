"""Micro-benchmark of the host tier's bookkeeping on the event loop (no copies, no daemon).

For each entry count N it fills a ``HostTier`` to capacity with N ready entries, leases
(pins) a share of them -- the coldest ones by default, the worst case for an eviction
that scans from the LRU end -- and then times, per request of ``--chunks`` keys:

- ``lookup``: ``ready_prefix`` of the keys of a stored prefix;
- ``store``: reserving ``--chunks`` new keys (each needs an eviction) and committing them;
- ``stats``: one ``stats()`` call;
- ``demote``: one watermark demotion pass (``Tiering.demote_pass``) after a store, with a
  stand-in disk that accepts every write at once (the pass's own cost, no IO).

Medians over ``--requests`` requests, in microseconds. Flat figures across N mean the
per-request cost does not grow with the number of cached entries. ``--journal`` runs each
size twice, without and with the warm-restart journal (kvd/tiers/host/journal.py: an index
record per commit, checksums on hashing threads), alternating, so the second row is its
cost on the event loop; ``--journal-delay S`` gives that journal a record delay
(``warm_record_delay_s``; default 0: a record per commit), and the ``flush`` column is the
time its delayed records took on the loop, per request. ``--rebuild`` instead times what a
restarted daemon does before it
serves, per size: reading the index file and rebuilding the entries
(kvd/tiers/host/adopt.py ``rebuild``, on a thread in the daemon) and ``HostTier.adopt`` (on the
loop). Usage:
``.venv/bin/python tools/host_tier_bench.py [--sizes 1000,10000,100000] [--leased 0.5]``
(the record delay's figures: ``--sizes 1500 --leased 0 --chunks 128 --requests 1000
--journal --journal-delay 0.1 --percentile 10``, docs/benchmarks.md in git history).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kvd.tiers.disk.tiering import Tiering
from kvd.tiers.host.adopt import rebuild
from kvd.tiers.host.arena_index import ArenaIndex
from kvd.tiers.host.journal import Hasher, Journal
from kvd.tiers.host.tier import HostTier

ENTRY = 256  # bytes per entry: the bookkeeping is what is measured, not copies
NS = b"n" * 16
try:  # lookups name their reader since they check its namespace
    from kvd.tiers.scope import Scope
    READER = Scope(NS, 1, ENTRY)
except ImportError:  # the API before that
    READER = None


class InstantDisk:
    """Stand-in for DiskTier: every write succeeds as soon as the loop runs again."""

    def __init__(self):
        self.entries = {}
        self.on_evict = None

    def submit_write(self, ns, key, payload, shards, shard_bytes):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(True)
        self.entries[key] = True
        return fut

    def get(self, key):
        return None


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _store(tier: HostTier, keys: list) -> None:
    if hasattr(tier, "reserve_many"):
        todo, _ = tier.reserve_many(keys, NS, ENTRY, 1, 0)
        entries = [e for _, e in todo]
    else:  # the API before the evictable-queue rewrite
        entries = [tier.reserve(k, NS, ENTRY, 1, 0)[0] for k in keys]
    if hasattr(tier, "commit_many"):
        tier.commit_many(entries, 0)
    else:  # the API before batched commits
        for e in entries:
            tier.commit(e, 0)


def _lookup(tier: HostTier, keys: list) -> list:
    return tier.ready_prefix(keys) if READER is None else tier.ready_prefix(keys, READER)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


async def measure(n: int, leased: float, chunks: int, requests: int, journal: str = "",
                  percentile: float = 50, delay: float = 0.0) -> dict:
    tier = HostTier(n * ENTRY, align=ENTRY)
    view = np.zeros(n * ENTRY, np.uint8)
    if journal:  # an index file beside a stand-in arena file, as the daemon keeps them
        arena = Path(journal) / "arena"
        arena.write_bytes(b"")
        index = ArenaIndex.create(Path(journal) / "arena.index", arena.stat(), n * ENTRY, ENTRY, 16)
        tier.journal = Journal(index, Hasher(view, 2, asyncio.get_running_loop()), None, delay,
                               tier.holds)
    flushes = _time_flushes(tier.journal) if journal else []
    for i in range(0, n, 1024):
        _store(tier, [_key(j) for j in range(i, min(i + 1024, n))])
    pinned = [tier.entries[_key(i)] for i in range(int(n * leased))]
    tier.pin(pinned)  # the coldest share is leased
    tiering = Tiering(tier, InstantDisk(), view)
    for _ in range(64):  # demote until the watermark is met, so passes start in a steady state
        tiering.demote_pass()
        await asyncio.sleep(0)
    hot = [_key(j) for j in range(n - chunks, n)]
    out = {"lookup": [], "store": [], "stats": [], "demote": []}
    flushes.clear()  # the fill's flushes are not the requests'
    fresh = n
    for _ in range(requests):
        out["lookup"].append(_timed(lambda: _lookup(tier, hot)))
        keys = [_key(j) for j in range(fresh, fresh + chunks)]
        fresh += chunks
        out["store"].append(_timed(lambda: _store(tier, keys)))
        out["stats"].append(_timed(tier.stats))
        out["demote"].append(_timed(tiering.demote_pass))
        await asyncio.sleep(0)  # demotions complete
        hot = keys
    tier.unpin(pinned)
    flushed = sum(flushes) / requests
    if journal:
        tier.journal.hasher.stop()
        tier.journal.index.close(clean=False)
    return {**{k: float(np.percentile(v, percentile)) for k, v in out.items()}, "flush": flushed}


def _time_flushes(journal) -> list:
    """Time each delayed batch ``journal`` records (µs) into the list returned."""
    times, record = [], journal._record_later

    def timed(*args) -> None:
        times.append(_timed(lambda: record(*args)))
    journal._record_later = timed
    return times


async def rebuild_seconds(n: int, tmp: str) -> tuple[float, float]:
    """(rebuild s, adopt s) for a tier of ``n`` entries recorded by a journal."""
    tier = HostTier(n * ENTRY, align=ENTRY)
    arena = Path(tmp) / "arena"
    arena.write_bytes(b"")
    index = ArenaIndex.create(Path(tmp) / "arena.index", arena.stat(), n * ENTRY, ENTRY, 16)
    hasher = Hasher(np.zeros(n * ENTRY, np.uint8), 2, asyncio.get_running_loop())
    tier.journal = Journal(index, hasher)
    for i in range(0, n, 1024):
        _store(tier, [_key(j) for j in range(i, min(i + 1024, n))])
    while hasher.pending:
        await asyncio.sleep(0.01)
    hasher.stop()
    gc.disable()  # as the daemon does (kvd/server/host_tier.py)
    t0 = time.perf_counter()
    adoption = rebuild(index, n * ENTRY, ENTRY, crashed=False)
    t1 = time.perf_counter()
    HostTier(n * ENTRY, align=ENTRY).adopt(adoption.entries)
    t2 = time.perf_counter()
    gc.enable()
    index.close(clean=False)
    assert len(adoption.entries) == n
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="entry counts, comma-separated")
    ap.add_argument("--leased", type=float, default=0.5, help="share of entries leased (coldest)")
    ap.add_argument("--chunks", type=int, default=64, help="keys per lookup and store")
    ap.add_argument("--requests", type=int, default=50, help="requests timed per size")
    ap.add_argument("--journal", action="store_true", help="also with the warm-restart journal")
    ap.add_argument("--journal-delay", type=float, default=0.0, help="with --journal: its record "
                    "delay in seconds (warm_record_delay_s; 0: a record per commit)")
    ap.add_argument("--percentile", type=float, default=50, help="the percentile of the requests "
                    "printed (50: the median; 10 on a noisy VM: the cost with the least steal)")
    ap.add_argument("--rebuild", action="store_true", help="time a restart's index rebuild instead")
    args = ap.parse_args()
    if args.rebuild:
        print(f"{'entries':>9}{'rebuild s':>11}{'adopt s':>9}")
        for n in (int(s) for s in args.sizes.split(",")):
            with tempfile.TemporaryDirectory(prefix="kvd-htb-", dir="/dev/shm") as tmp:
                built, adopted = asyncio.run(rebuild_seconds(n, tmp))
            print(f"{n:>9}{built:>11.3f}{adopted:>9.3f}", flush=True)
        return
    print(f"host tier bookkeeping, {args.chunks} keys per request, {args.leased:.0%} leased "
          f"(coldest), percentile {args.percentile:g} of {args.requests} requests, us "
          f"(pid {os.getpid()})")
    print(f"{'entries':>9}{'lookup':>10}{'store':>10}{'stats':>10}{'demote':>10}{'flush':>10}")
    for n in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="kvd-htb-", dir="/dev/shm") as tmp:
            for journal in ("", tmp) if args.journal else ("",):
                r = asyncio.run(measure(n, args.leased, args.chunks, args.requests, journal,
                                        args.percentile, args.journal_delay))
                print(f"{n:>9}{r['lookup']:>10.0f}{r['store']:>10.0f}{r['stats']:>10.0f}"
                      f"{r['demote']:>10.0f}{r['flush']:>10.0f}{'  journal' if journal else ''}",
                      flush=True)


if __name__ == "__main__":
    main()
