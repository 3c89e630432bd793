"""``kvd bench --page-order``: the engines' page ids (kvd.bench.common.page_sets).

Random (the default, the worst case), sorted and contiguous sets are
disjoint halves of the pool's first 2n pages; what each makes of a per-layer
DeepSeek-MLA copy (kvd.cuda.dma.plan.CopyOps, no GPU): one row per (layer,
page) at random ids, one per (layer, chunk) when a chunk's pages are
consecutive.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.bench.common import PAGE_ORDERS, page_sets
from kvd.cuda.dma.plan import CopyOps

import instant_cupy as stub


@pytest.mark.parametrize("order", PAGE_ORDERS)
def test_page_sets_are_disjoint_halves(order):
    a, b = page_sets(order, 64, seed=3)
    assert a.dtype == b.dtype == np.int64 and len(a) == len(b) == 64
    assert sorted(np.concatenate([a, b]).tolist()) == list(range(128))
    again = page_sets(order, 64, seed=3)
    assert np.array_equal(a, again[0]) and np.array_equal(b, again[1])


def test_sorted_is_random_in_order_and_contiguous_is_two_ranges():
    ra, rb = page_sets("random", 64, seed=5)
    sa, sb = page_sets("sorted", 64, seed=5)
    assert np.array_equal(sa, np.sort(ra)) and np.array_equal(sb, np.sort(rb))
    assert not np.array_equal(ra, sa)
    ca, cb = page_sets("contiguous", 64, seed=5)
    assert ca.tolist() == list(range(64)) and cb.tolist() == list(range(64, 128))


def rows_of(order: str) -> int:
    """Single rows of a per-layer MLA store of 8 chunks of 256 tokens at pages of 64."""
    layout, bases = stub.pool(61, 1, 1152, 64, "per-layer")
    ids, _ = page_sets(order, 8 * 4, seed=1)
    ptrs = np.uint64(stub.ARENA) + np.arange(8, dtype=np.uint64) * np.uint64(layout.shard_bytes(256))
    c = CopyOps(layout, bases, ids, ptrs, 256, (stub.ARENA, stub.PIECE), to_host=True)
    return sum(step.size.size + step.ops.size for step in c.steps(1 << 62))


def test_contiguous_pages_are_one_copy_per_layer_and_chunk():
    assert rows_of("random") > 61 * 8 * 3  # adjacent only by chance
    assert 61 * 8 < rows_of("sorted") < rows_of("random")
    assert rows_of("contiguous") == 61 * 8


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="random, sorted, contiguous"):
        page_sets("shuffled", 4, seed=0)
