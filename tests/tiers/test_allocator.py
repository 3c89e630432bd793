"""The host arena's extent allocator (kvd.tiers.host.allocator): alignment, coalescing, no overlap."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvd.tiers.host.allocator import ExtentAllocator


def test_alloc_aligned_and_sequential():
    a = ExtentAllocator(4096, align=256)
    offs = [a.alloc(n) for n in (1, 256, 257, 0)]
    assert offs == [0, 256, 512, 1024]
    assert a.used == 256 + 256 + 512 + 256
    assert all(o % 256 == 0 for o in offs)
    assert a.rounded(257) == 512 and a.rounded(256) == 256


def test_capacity_rounded_down_and_never_exceeded():
    a = ExtentAllocator(1000, align=256)
    assert a.capacity == 768
    assert a.alloc(769) is None
    assert a.alloc(768) == 0
    assert a.alloc(1) is None
    assert ExtentAllocator(100, align=256).alloc(1) is None


def test_free_coalesces_neighbours():
    a = ExtentAllocator(4 * 256, align=256)
    slots = [a.alloc(256) for _ in range(4)]
    assert slots == [0, 256, 512, 768] and a.alloc(1) is None
    a.free(256, 256)
    a.free(768, 256)
    assert a.largest_free() == 256
    assert a.alloc(512) is None  # free space is fragmented
    a.free(512, 256)  # merges with both neighbours
    assert a.largest_free() == 768
    assert a.alloc(768) == 256
    a.free(256, 768)
    a.free(0, 256)
    assert a.used == 0 and a.largest_free() == 1024
    assert a.alloc(1024) == 0


def test_exact_size_slot_reuse():
    a = ExtentAllocator(10 * 512, align=256)
    offs = [a.alloc(512) for _ in range(10)]
    a.free(offs[6], 512)
    assert a.alloc(512) == offs[6]


def test_mixed_sizes_take_the_smallest_fitting_extent():
    a = ExtentAllocator(8 * 256, align=256)
    offs = [a.alloc(n) for n in (512, 256, 1024, 256)]
    assert offs == [0, 512, 768, 1792]
    a.free(0, 512)
    a.free(768, 1024)
    assert a.alloc(256) == 0  # best fit: the 512-byte hole, not the 1024-byte one
    assert a.alloc(1024) == 768


def _free_runs(taken: np.ndarray, align: int) -> int:
    """Longest run of free aligned units in the byte map, in bytes."""
    free = ~taken.reshape(-1, align).any(axis=1)
    edges = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return int((ends - starts).max(initial=0)) * align


@pytest.mark.parametrize("align,seed", [(256, 0), (64, 1), (8, 2)])
def test_random_alloc_free_never_overlaps(align, seed):
    rng = random.Random(seed)
    capacity = 64 * 1024 + 37
    a = ExtentAllocator(capacity, align)
    taken = np.zeros(a.capacity, dtype=bool)
    live = {}
    for step in range(1500):
        if live and (rng.random() < 0.45 or len(live) > 60):
            start = rng.choice(list(live))
            size = live.pop(start)
            assert taken[start:start + a.rounded(size)].all()
            taken[start:start + a.rounded(size)] = False
            a.free(start, size)
        else:
            size = rng.choice([rng.randrange(1, 4096), 2048, 512, rng.randrange(1, 20000)])
            need = a.rounded(size)
            fits = _free_runs(taken, align) >= need
            start = a.alloc(size)
            if start is None:
                assert not fits, f"step {step}: {need} bytes were free in one run but alloc failed"
                continue
            assert fits
            assert start % align == 0 and start + need <= a.capacity
            assert not taken[start:start + need].any(), f"step {step}: overlap at {start}"
            taken[start:start + need] = True
            live[start] = size
        assert a.used == int(taken.sum()) <= a.capacity
        assert a.largest_free() == _free_runs(taken, align)
    for start, size in live.items():
        a.free(start, size)
    assert a.used == 0 and a.largest_free() == a.capacity
