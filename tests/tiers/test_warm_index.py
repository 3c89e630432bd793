"""Warm restart below the daemon: the index file, the journal's hooks, rebuilding a host tier.

A real ``ArenaIndex`` on a real arena file in a temp dir, a real ``HostTier``
with a ``Journal`` whose ``Hasher`` threads hash the real bytes; the event
loop is asyncio's. The daemon-level behaviour (kills, restarts) is in
tests/server/test_warm_restart.py.
"""

from __future__ import annotations

import asyncio
import functools
import mmap
import os
import sys

import numpy as np
import pytest
import xxhash

from kvd.server.copy_gate import Idle
from kvd.tiers.host import journal as journal_module
from kvd.tiers.host.adopt import rebuild, verify
from kvd.tiers.host.allocator import ExtentAllocator
from kvd.tiers.host.arena_index import HEADER, LIVE, RECORD, SEALED, ArenaIndex, IndexProblem
from kvd.tiers.host.journal import Hasher, Journal
from kvd.tiers.host.tier import HostTier
from kvd.tiers.scope import Scope

SLOT = 4096
CAP = 64 * SLOT
NS = b"n" * 16
HALVES = Scope(NS, 2, SLOT // 2)  # a reader of entries of two shards


def on_loop(test):
    """Run an async test on a fresh asyncio loop (the daemon's tier code runs on one)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return run


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def arena(tmp_path):
    path = tmp_path / "arena"
    with open(path, "wb") as f:
        f.truncate(CAP)
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, CAP)
    os.close(fd)
    view = np.frombuffer(m, np.uint8)
    view[:] = np.random.default_rng(1).integers(0, 256, CAP, dtype=np.uint8)
    yield path, view


def make_tier(arena, index=None, live=None, capacity=CAP):
    path, view = arena
    index = index or ArenaIndex.create(path.with_name("arena.index"), path.stat(), capacity,
                                       SLOT, 16)
    tier = HostTier(capacity, SLOT)
    tier.journal = Journal(index, Hasher(view, 2, asyncio.get_running_loop()), live)
    return tier


async def settle(journal) -> None:
    while journal.hasher.pending:
        await asyncio.sleep(0.005)


def store(tier, ids, shards=1, rank=0):
    todo, _ = tier.reserve_many([key(i) for i in ids], NS, SLOT // shards, shards, rank)
    for _, e in todo:
        tier.commit(e, rank)
    return [e for _, e in todo]


async def reopen(tier) -> ArenaIndex:
    """Close the index as a daemon's exit would (not clean: as after a crash) and open it."""
    await settle(tier.journal)
    tier.journal.hasher.stop()
    tier.journal.index.close(clean=False)
    return ArenaIndex.open(tier.journal.index.path)


@on_loop
async def test_records_follow_commits_drops_and_checksums(arena):
    tier = make_tier(arena)
    entries = store(tier, range(4))
    await settle(tier.journal)
    numbers, recs = tier.journal.index.live_records()
    assert sorted(recs["key"].tobytes()[i * 16:(i + 1) * 16] for i in range(4)) == \
        [key(i) for i in range(4)]
    view = arena[1]
    for e, rec in zip(sorted(entries, key=lambda e: e.recs[0]), recs):
        assert rec["flags"] & SEALED and rec["offset"] == e.offset
        assert rec["digest"] == xxhash.xxh3_64_intdigest(view[e.offset:e.offset + SLOT])
    tier.clear()
    assert len(tier.journal.index.live_records()[0]) == 0
    assert tier.journal.stats()["sealed_shards"] == 4


@on_loop
async def test_a_checksum_of_a_slot_reused_meanwhile_is_not_written(arena):
    tier = make_tier(arena)
    tier.journal.hasher.stop()  # hashing stalls: the digest comes back after the eviction
    tier.journal.hasher = stalled = Hasher(arena[1], 1, asyncio.get_running_loop())
    stalled.stop()  # no thread: jobs wait in the queue
    (e,) = store(tier, [1])
    (number,) = e.recs
    callback, payload, offsets, sizes, stale, patient = stalled.jobs.get_nowait()
    assert patient  # the journal's checksums yield to copies
    assert offsets == [e.offset] and sizes == [SLOT] and not stale().any()
    tier.journal.dropped(e)  # an eviction, undone (a reservation that failed): same bytes
    assert stale().all()
    tier.journal.restored(e)
    assert not stale().any()
    tier.clear()
    assert stale().all()  # freed: a hashing thread would skip it now
    store(tier, [2])  # the same slot and record number, another generation
    assert tier.journal.index.live_records()[0].tolist() == [number]
    assert stale().all()
    callback(payload, np.array([12345], np.uint64), np.array([True]))  # read before the reuse
    assert tier.journal.stats()["checksums_stale"] == 1  # read for nothing, and counted
    assert not tier.journal.index.live_records()[1]["flags"][0] & SEALED


class Unreadable:
    """An arena view that fails the hashing thread which reads it."""

    def __getitem__(self, _):
        raise AssertionError("a stale shard's bytes were read")


@on_loop
async def test_shards_evicted_before_their_turn_are_skipped_unread(arena):
    """A queue of checksums behind a stream of stores: the shards evicted meanwhile are
    never read (their bytes are another store's by then), are counted, and leave
    nothing unsealed; a live one queued behind them is still sealed."""
    tier = make_tier(arena)
    tier.journal.hasher.stop()
    tier.journal.hasher = stalled = Hasher(arena[1], 1, asyncio.get_running_loop())
    stalled.stop()  # no thread: jobs wait in the queue
    store(tier, range(3))
    jobs = [stalled.jobs.get_nowait() for _ in range(2)]  # one per commit, 2 per thread
    assert stalled.jobs.empty()  # the third waits as its record's flag
    assert tier.journal.stats()["unsealed_shards"] == 3
    tier.clear()
    stats = tier.journal.stats()  # the waiting one is dropped at once
    assert stats["unsealed_shards"] == 2 and stats["checksums_skipped"] == 1, stats
    tier.journal.hasher = Hasher(Unreadable(), 1, asyncio.get_running_loop())
    for job in jobs:
        tier.journal.hasher.submit(*job)
    await asyncio.wait_for(settle(tier.journal), 10)
    stats = tier.journal.stats()
    assert stats["checksums_skipped"] == 3 and stats["unsealed_shards"] == 0, stats
    assert stats["sealed_shards"] == 0
    tier.journal.hasher.stop()
    tier.journal.hasher = Hasher(arena[1], 1, asyncio.get_running_loop())
    (e,) = store(tier, [7])
    await settle(tier.journal)
    assert tier.journal.stats()["sealed_shards"] == 1
    tier.journal.hasher.stop()


@on_loop
async def test_checksums_wait_for_the_copies_to_stay_idle(arena, monkeypatch):
    """The journal's hashing gives way to copies: a shard is not read while copies are
    queued (the gate's ``Idle`` clear) nor in a pause shorter than ``QUIET_S``; it is
    read once they stayed idle that long; one evicted while it waits is skipped unread
    with the rest of its job, copies queued or not; under endless copies nothing is read,
    and stopping does not wait for them."""
    monkeypatch.setattr(journal_module, "QUIET_S", 0.5)
    monkeypatch.setattr(journal_module, "CHECK_S", 0.02)
    idle = Idle()
    idle.clear()  # copies are queued
    tier = make_tier(arena)
    tier.journal.hasher.idle = idle
    store(tier, [1])
    await asyncio.sleep(0.3)
    assert tier.journal.stats()["unsealed_shards"] == 1
    idle.set()  # a pause shorter than QUIET_S
    await asyncio.sleep(0.05)
    idle.clear()
    await asyncio.sleep(0.7)
    assert tier.journal.stats()["sealed_shards"] == 0
    idle.set()
    t0 = asyncio.get_running_loop().time()
    await asyncio.wait_for(settle(tier.journal), 10)
    assert asyncio.get_running_loop().time() - t0 >= 0.4
    assert tier.journal.stats()["sealed_shards"] == 1
    idle.clear()
    store(tier, [2, 3, 4])
    await asyncio.sleep(0.1)
    tier.clear()  # evicted while their checksums wait: skipped unread, copies still queued
    await asyncio.wait_for(settle(tier.journal), 2)
    stats = tier.journal.stats()
    assert stats["checksums_skipped"] == 3 and stats["sealed_shards"] == 1, stats
    store(tier, [5])  # copies never pause: never read
    await asyncio.sleep(0.3)
    assert tier.journal.stats()["unsealed_shards"] == 1
    t0 = asyncio.get_running_loop().time()
    tier.journal.hasher.stop()
    assert asyncio.get_running_loop().time() - t0 < 1.0
    assert not any(t.is_alive() for t in tier.journal.hasher._threads)


@on_loop
async def test_a_rebuild_after_a_crash_verifies_and_drops_a_bad_shard(arena):
    tier = make_tier(arena)
    a = store(tier, range(3), shards=2, rank=0)
    store(tier, range(3), shards=2, rank=1)
    store(tier, [9], shards=2, rank=0)  # rank 1 never stored: a partial entry
    await settle(tier.journal)
    view = arena[1]
    view[a[1].shard_offset(1) + 5] ^= 0xFF  # a byte of key 1, rank 1 goes bad
    index = await reopen(tier)
    adoption = rebuild(index, CAP, SLOT, crashed=True)
    assert len(adoption.entries) == 4 and adoption.bad_records == 0
    fresh = HostTier(CAP, SLOT)
    fresh.adopt(adoption.entries)
    fresh.journal = journal = Journal(index, Hasher(view, 2, asyncio.get_running_loop()),
                                      adoption.live)
    assert fresh.ready_prefix([key(0)], HALVES) == []  # unverified: no hit
    await verify(fresh, journal, adoption.checks)
    assert journal.counters["checksum_failures"] == 1 and journal.counters["verified_shards"] == 6
    assert [len(fresh.ready_prefix([key(i)], HALVES)) for i in (0, 1, 2, 9)] == [1, 0, 1, 0]
    assert key(1) not in fresh.entries and fresh.entries[key(9)].stored == 1
    assert len(index.live_records()[0]) == 5  # key 1's two records are freed in the file
    journal.hasher.stop()


@on_loop
async def test_after_a_clean_stop_everything_is_trusted_and_lru_order_kept(arena):
    tier = make_tier(arena)
    store(tier, range(4))
    tier.ready_prefix([key(0)], Scope(NS, 1, SLOT))  # 0 becomes the most recently used
    await settle(tier.journal)
    tier.journal.hasher.stop()
    tier.journal.checkpoint(tier.entries.values())
    tier.journal.index.close(clean=True)
    index = ArenaIndex.open(tier.journal.index.path)
    assert index.head["state"] == 2  # CLEAN
    adoption = rebuild(index, CAP, SLOT, crashed=False)
    fresh = HostTier(CAP, SLOT)
    fresh.adopt(adoption.entries)
    assert not adoption.checks and fresh.ready_count == 4
    assert [int.from_bytes(e.key, "little") for e in fresh.lru] == [1, 2, 3, 0]
    index.close(clean=False)


@on_loop
async def test_inconsistent_records_are_dropped_and_freed(arena):
    tier = make_tier(arena)
    entries = store(tier, range(4))
    index = await reopen(tier)
    write = index.write
    # a second record for key 0 with another offset; key 1 twice at rank 0; a record
    # overlapping key 2's slot under key 7; rank past shards; an offset past the end
    e0, e2 = entries[0], entries[2]
    write(60, 0, 0, 1, key(0), NS, e0.offset + SLOT * 10, SLOT, 0, 1, 0)
    write(61, 0, 0, 1, key(1), NS, entries[1].offset, SLOT, 0, 1, 0)
    write(62, 0, 0, 1, key(7), NS, e2.offset, SLOT, 0, 1, 0)
    write(63, 0, 3, 2, key(8), NS, 50 * SLOT, SLOT, 0, 1, 0)
    write(59, 0, 0, 1, key(5), NS, CAP, SLOT, 0, 1, 0)
    adoption = rebuild(index, CAP, SLOT, crashed=False)
    assert sorted(int.from_bytes(e.key, "little") for e in adoption.entries) == [3]
    assert adoption.bad_records == 8
    assert len(index.live_records()[0]) == 1
    HostTier(CAP, SLOT).adopt(adoption.entries)
    index.close(clean=False)


@on_loop
async def test_a_torn_state_word_is_no_record(arena):
    """A record's state word is set last; a daemon killed while setting it left part of
    ``LIVE`` over a free word: no record (and the body alone never is one)."""
    tier = make_tier(arena)
    store(tier, [1])
    index = await reopen(tier)
    n = index.records - 1
    index.write(n, 0, 0, 1, key(2), NS, 8 * SLOT, SLOT, 0, 1, 0)
    at = HEADER + n * RECORD
    index.set_state(n, False)
    assert len(index.live_records()[0]) == 1
    for cut in (1, 2, 3):
        index.set_state(n, False)
        index._map[at:at + cut] = LIVE.to_bytes(4, sys.byteorder)[:cut]
        assert len(index.live_records()[0]) == 1
    index.set_state(n, True)
    assert len(index.live_records()[0]) == 2
    index.close(clean=False)


@on_loop
async def test_the_table_grows_and_evictions_free_records(arena):
    tier = make_tier(arena, capacity=CAP)
    index = tier.journal.index
    first = index.records
    for i in range(first // 64 + 2):  # more commits than records: evictions free them
        store(tier, range(i * 64, i * 64 + 64))
    assert index.records == first  # 64 slots: never more than 64 live records
    tiny = HostTier(2 * first * 256, 256)  # shards of 256 bytes: more records than the table
    tiny.journal = Journal(index, tier.journal.hasher, None)
    tier.clear()
    todo, _ = tiny.reserve_many([key(i) for i in range(first + 10)], NS, 256, 1, 0)
    for _, e in todo:
        tiny.commit(e, 0)
    assert index.records == 2 * first and len(index.live_records()[0]) == first + 10
    tier.journal.hasher.stop()
    index.close(clean=False)


def test_an_index_of_another_arena_or_settings_is_refused(arena, tmp_path):
    path, _ = arena
    index = ArenaIndex.create(tmp_path / "arena.index", path.stat(), CAP, SLOT, 16)
    st = path.stat()
    assert index.problem(st, CAP, SLOT, 16) is None
    assert "chunk_tokens 16" in index.problem(st, CAP, SLOT, 32)
    assert "host_capacity" in index.problem(st, 2 * CAP, SLOT, 16)
    assert "slot alignment 4096" in index.problem(st, CAP, 256, 16)
    other = tmp_path / "other"
    other.write_bytes(b"x")
    assert "another arena file" in index.problem(other.stat(), CAP, SLOT, 16)
    index.close(clean=True)
    (tmp_path / "junk.index").write_bytes(b"\0" * (HEADER + RECORD))
    with pytest.raises(IndexProblem, match="not a kvd host tier index"):
        ArenaIndex.open(tmp_path / "junk.index")
    (tmp_path / "short.index").write_bytes(b"\0" * 10)
    with pytest.raises(IndexProblem, match="size"):
        ArenaIndex.open(tmp_path / "short.index")


def test_unverified_shards_are_no_hits_dedup_stores_and_survive_aborts():
    tier = HostTier(16 * SLOT, SLOT)
    (e,) = [e for _, e in tier.reserve_many([key(1)], NS, SLOT // 2, 2, 0)[0]]
    tier.commit(e, 0)
    tier.entries.clear()  # as adopted after a crash: rank 0 unverified, rank 1 missing
    tier.lru = type(tier.lru)()
    e.stored, e.unverified, e.lru_next, e.lru_prev = 0, 1, None, None
    tier.adopt([e])
    assert tier.ready_prefix([key(1)], HALVES) == []
    todo, deduped = tier.reserve_many([key(1)], NS, SLOT // 2, 2, 0)
    assert todo == [] and deduped == 1  # a store of an unverified shard: a dedup
    todo, _ = tier.reserve_many([key(1)], NS, SLOT // 2, 2, 1)
    tier.abort(todo[0][1], 1)  # rank 1's store fails: rank 0 (unverified) stays
    assert tier.entries[key(1)] is e
    assert tier.verified(e, 0, True) is True and tier.verified(e, 0, True) is None
    assert tier.ready_count == 0  # rank 1 still missing
    tier.commit(tier.reserve_many([key(1)], NS, SLOT // 2, 2, 1)[0][0][1], 1)
    assert tier.ready_prefix([key(1)], HALVES) == [e] and tier.ready_count == 1


def test_allocator_around_takes_the_used_extents():
    a = ExtentAllocator.around(10 * SLOT, SLOT, [(3 * SLOT, SLOT), (0, 2 * SLOT)])
    assert a.used == 3 * SLOT
    got = sorted(a.alloc(SLOT) for _ in range(7))
    assert got == [2 * SLOT] + [i * SLOT for i in range(4, 10)]
    assert a.alloc(SLOT) is None
    with pytest.raises(ValueError):
        ExtentAllocator.around(10 * SLOT, SLOT, [(0, 2 * SLOT), (SLOT, SLOT)])
    with pytest.raises(ValueError):
        ExtentAllocator.around(10 * SLOT, SLOT, [(9 * SLOT, 2 * SLOT)])
