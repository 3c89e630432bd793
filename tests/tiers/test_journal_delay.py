"""The journal's record delay (``warm_record_delay_s``): a commit's records are written
``delay`` seconds later, in one batch, and only for the shards the tier still holds.

Real ``HostTier``, ``ArenaIndex`` and ``Hasher`` threads as in test_warm_index.py; the
daemon-level kill with records waiting is in tests/server/test_warm_restart.py.
"""
# ruff: noqa: F811  (``arena`` is test_warm_index's fixture, imported so that pytest finds it)

from __future__ import annotations

import asyncio

import pytest
from test_warm_index import CAP, SLOT, arena, key, make_tier, on_loop, settle, store  # noqa: F401

from kvd.tiers.host.journal import Journal

DELAY = 0.4
EARLY = 0.02  # a look well before the delay is over (a stall of 0.38 s would spoil it)


def delayed(arena, delay: float = DELAY):
    tier = make_tier(arena, capacity=CAP)
    j = tier.journal
    tier.journal = Journal(j.index, j.hasher, None, delay, tier.holds)
    return tier


def recorded_keys(journal) -> set:
    _, recs = journal.index.live_records()
    raw = recs["key"].tobytes()
    return {raw[i * 16:(i + 1) * 16] for i in range(len(recs))}


async def until_recorded(journal, timeout: float = 10.0) -> None:
    """Until no batch waits (each is recorded on its own turn of the loop, after DELAY)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while journal.stats()["records_pending"] and loop.time() < deadline:
        await asyncio.sleep(0.01)


def close(tier) -> None:
    tier.journal.hasher.stop()
    tier.journal.index.close(clean=False)


@on_loop
async def test_records_wait_for_the_delay_and_skip_what_was_evicted_meanwhile(arena):
    tier = delayed(arena)
    j = tier.journal
    store(tier, range(CAP // SLOT))  # a full tier
    store(tier, range(100, 104))  # evicts the four least recently used: 0-3
    stats = j.stats()
    assert recorded_keys(j) == set() and stats["records_pending"] == 68, stats
    assert stats["unsealed_shards"] == 68  # committed, not summed yet: counted as unsealed
    await asyncio.sleep(EARLY)
    assert recorded_keys(j) == set()  # not before the delay
    await until_recorded(j)
    assert recorded_keys(j) == {key(i) for i in [*range(4, 64), *range(100, 104)]}
    stats = j.stats()
    assert stats["records_pending"] == 0 and stats["records_skipped"] == 4, stats
    await settle(j)
    stats = j.stats()
    assert stats["unsealed_shards"] == 0 and stats["sealed_shards"] == 64, stats
    close(tier)


@on_loop
async def test_each_batch_starts_its_own_delay_and_flush_writes_at_once(arena):
    tier = delayed(arena)
    j = tier.journal
    store(tier, [1])
    await until_recorded(j)
    assert recorded_keys(j) == {key(1)}
    store(tier, [2])  # a new batch: a new timer, from now
    await asyncio.sleep(EARLY)
    assert recorded_keys(j) == {key(1)}
    j.flush()  # a stopping daemon's drain: now, and the timer is cancelled
    assert recorded_keys(j) == {key(1), key(2)} and j.stats()["records_pending"] == 0
    tier.clear()
    await asyncio.sleep(DELAY)  # the cancelled timer writes nothing back
    assert recorded_keys(j) == set()
    await settle(j)
    assert j.stats()["unsealed_shards"] == 0
    close(tier)


@on_loop
async def test_only_the_shards_committed_are_recorded(arena):
    """An entry of two shards with one stored: the other gets no record."""
    tier = delayed(arena)
    j = tier.journal
    (e,) = store(tier, [7], shards=2, rank=0)
    j.flush()
    assert e.recs[0] >= 0 and e.recs[1] == -1
    assert len(j.index.live_records()[0]) == 1
    await settle(j)
    close(tier)


@on_loop
async def test_records_waiting_at_a_closed_index_are_dropped_not_written(arena):
    tier = delayed(arena)
    j = tier.journal
    store(tier, range(3))
    j.hasher.stop()
    j.index.close(clean=False)
    j.flush()  # after the index closed: nothing written, nothing counted as unsealed
    stats = j.stats()
    assert stats["records_pending"] == 0 and stats["unsealed_shards"] == 0, stats


@on_loop
async def test_a_backlog_of_due_batches_is_recorded_one_batch_per_turn_of_the_loop(arena):
    """The loop is never held by a long flush: one request's batch per callback."""
    import time
    tier = delayed(arena)
    j = tier.journal
    store(tier, range(6))  # six commits of one entry each: six batches
    time.sleep(DELAY * 1.2)  # the loop is busy: all of them fall due meanwhile
    counts = []
    for _ in range(12):
        await asyncio.sleep(0)
        counts.append(len(recorded_keys(j)))
    assert counts[-1] == 6 and all(b - a in (0, 1) for a, b in zip([0, *counts], counts)), counts
    await settle(j)
    close(tier)


@on_loop
async def test_a_delay_without_holds_is_refused(arena):
    tier = make_tier(arena)
    with pytest.raises(ValueError, match="holds"):
        Journal(tier.journal.index, tier.journal.hasher, None, DELAY)
    close(tier)
