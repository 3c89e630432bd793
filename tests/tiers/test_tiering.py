"""Watermark demotion (kvd.tiers.disk.tiering) over a real host tier index and a real disk tier,
in one process: which entries a pass writes, where they go back in the LRU, and that a pass
resumes where the last one stopped."""

from __future__ import annotations

import asyncio

import numpy as np

from kvd.tiers.disk.tier import DiskTier
from kvd.tiers.disk.tiering import Tiering
from kvd.tiers.host.tier import HostTier
from kvd.tiers.scope import Scope

SLOT = 4096
NS = b"n" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def ids(entries) -> list[int]:
    return [int.from_bytes(e.key, "little") for e in entries]


def store(host: HostTier, view, idx) -> None:
    todo, _ = host.reserve_many([key(i) for i in idx], NS, SLOT, 1, 0)
    for _, e in todo:
        view[e.offset:e.offset + SLOT] = int.from_bytes(e.key, "little") % 251
        host.commit(e, 0)


async def demote(tiering, disk) -> int:
    """Passes until one queues nothing (at most PINNED_SHARE of the tier is in flight)."""
    total = 0
    while n := tiering.demote_pass():
        total += n
        await disk.flush()
        await asyncio.sleep(0)  # the write callbacks run
    return total


def run(tmp_path, body) -> None:
    async def main():
        host = HostTier(20 * SLOT, SLOT)
        view = np.zeros(host.capacity, np.uint8)
        disk = DiskTier(tmp_path / "disk", 64 * 2 * SLOT, threads=2, direct=False)
        tiering = Tiering(host, disk, view, high_watermark=0.5)
        try:
            await body(host, view, disk, tiering)
        finally:
            await tiering.stop()
    asyncio.run(main())


def test_a_pass_writes_the_coldest_evictable_entries_and_resumes(tmp_path):
    async def body(host, view, disk, tiering):
        store(host, view, range(15))  # 75% full: the coldest 15 - 8 = 7 slots go to disk
        host.pin([host.entries[key(0)]])  # leased: not evictable, not demoted
        assert await demote(tiering, disk) == 7
        on_disk = [i for i in range(15) if host.entries[key(i)].on_disk]
        assert on_disk == list(range(1, 8))
        # written and untouched: back at the cold end, in their order
        assert ids(host.lru)[:7] == list(range(1, 8))
        assert tiering.demote_pass() == 0 and host.scan_next() is host.entries[key(8)]
        store(host, view, range(15, 20))  # full: 20 - 8 = 12 slots must be covered
        assert await demote(tiering, disk) == 5
        store(host, view, range(20, 30))  # evicts 10 entries, all already on disk
        st = host.stats()
        assert st["evictions"] == 10 and st["evicted_not_on_disk"] == 0
        assert not host.entries[key(0)].on_disk
        assert tiering.stats()["demotions"] == 12
    run(tmp_path, body)


def test_an_entry_that_leaves_the_disk_is_examined_again(tmp_path):
    async def body(host, view, disk, tiering):
        store(host, view, range(12))
        assert await demote(tiering, disk) == 4
        victim = disk.entries[key(1)]
        disk._forget(victim, delete=True)  # as the disk LRU does when it needs room
        await disk.flush()
        assert not host.entries[key(1)].on_disk
        assert await demote(tiering, disk) == 1  # only entry 1: the rest are still on disk
        assert all(host.entries[key(i)].on_disk for i in range(4))
    run(tmp_path, body)


def test_a_hit_during_the_write_keeps_the_entry_hot(tmp_path):
    async def body(host, view, disk, tiering):
        store(host, view, range(12))
        assert tiering.demote_pass() == 2  # entries 0 and 1 (PINNED_SHARE: 2 slots at once)
        host.ready_prefix([key(1)], Scope(NS, 1, SLOT))  # looked up while its write is in flight
        await disk.flush()
        await asyncio.sleep(0)
        assert ids(host.lru)[0] == 0 and ids(host.lru)[-1] == 1
    run(tmp_path, body)
