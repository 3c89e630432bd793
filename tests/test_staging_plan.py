"""The copy planners of kvd.cuda_staging and kvd.cuda_dma (pure functions, no GPU)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvd.cuda_dma import direct_runs
from kvd.cuda_staging import MAX_PITCH, host_runs, plan_pieces

MiB = 1 << 20


def covered(pieces):
    return sorted((c, l) for c0, c1, a, b in pieces for c in range(c0, c1) for l in range(a, b))


@pytest.mark.parametrize("n,layers,layer_bytes,slot,per_layer", [
    (8, 32, MiB, 8 * MiB, False), (8, 32, MiB, 8 * MiB, True), (1, 32, MiB, 8 * MiB, False),
    (1, 32, MiB, 8 * MiB, True), (3, 61, 294912, 8 * MiB, False), (64, 5, 3 * MiB, 8 * MiB, True),
    (5, 7, 8 * MiB, 8 * MiB, False), (2, 3, 100, 1000, False), (17, 1, 3, 7, True)])
def test_pieces_cover_each_chunk_layer_once_and_fit(n, layers, layer_bytes, slot, per_layer):
    for begin in (0, 1):
        pieces = plan_pieces(n, begin, layers, layer_bytes, slot, per_layer)
        assert covered(pieces) == list(itertools.product(range(n), range(begin, layers)))
        for c0, c1, a, b in pieces:
            assert 0 <= c0 < c1 <= n and begin <= a < b <= layers
            assert (c1 - c0) * (b - a) * layer_bytes <= slot
            assert b - a == 1 or not per_layer
        starts = [a for _, _, a, _ in pieces]
        assert starts == sorted(starts), "layer groups must be queued in order"


def test_pieces_fill_slots_and_degenerate_cases():
    # llama-3-8b, 8 chunks of 256 tokens: one 8 MiB piece per layer, all chunks
    assert plan_pieces(8, 0, 32, MiB, 8 * MiB, False) == [(0, 8, a, a + 1) for a in range(32)]
    # one chunk: 8 layers a piece, or one layer a piece when loading layer by layer
    assert plan_pieces(1, 0, 32, MiB, 8 * MiB, False) == [(0, 1, a, a + 8) for a in range(0, 32, 8)]
    assert len(plan_pieces(1, 0, 32, MiB, 8 * MiB, True)) == 32
    # balanced: 9 chunks in 8-chunk slots -> two groups of 5 and 4, not 8 and 1
    assert {c1 - c0 for c0, c1, _, _ in plan_pieces(9, 0, 2, MiB, 8 * MiB, False)} == {5, 4}
    assert plan_pieces(0, 0, 32, MiB, 8 * MiB, False) == []
    assert plan_pieces(4, 3, 3, MiB, 8 * MiB, False) == []
    assert plan_pieces(4, 0, 3, 9 * MiB, 8 * MiB, False) is None


def test_host_runs():
    assert host_runs([]) == []
    assert host_runs([100]) == [(0, 1, 0)]
    assert host_runs([0, 10, 20, 30]) == [(0, 4, 10)]
    assert host_runs([0, 10, 20, 25, 30, 35, 100]) == [(0, 3, 10), (3, 3, 5), (6, 1, 0)]
    assert host_runs([30, 20, 10]) == [(0, 1, 0), (1, 1, 0), (2, 1, 0)]
    assert host_runs([0, MAX_PITCH + 1, 2 * MAX_PITCH + 2]) == [(0, 1, 0), (1, 1, 0), (2, 1, 0)]
    assert host_runs([5, 5 + MAX_PITCH]) == [(0, 2, MAX_PITCH)]


@pytest.mark.parametrize("planes,page_size", [(2, 4), (1, 1), (2, 8)])
def test_direct_runs_cover_every_row_once(planes, page_size):
    """Expanded to rows, the runs map each canonical row to its pool row."""
    rng = np.random.default_rng(page_size)
    layers, chunk, row, n = 3, 8, 16, 3
    ppc = chunk // page_size
    bases = (np.arange(layers * planes, dtype=np.uint64) + 1) * np.uint64(1 << 20)
    pages = rng.permutation(4 * n * ppc)[:n * ppc]
    pages[:2] = [7, 8]  # consecutive pages of chunk 0 merge (when there are two)
    shards = np.array([(c + 1) << 30 for c in (2, 0, 1)], np.uint64)
    runs = direct_runs(bases, pages, shards, range(1, layers), planes, chunk, page_size,
                       page_size * row, row)
    got = {}
    for pool, canon, sizes in runs:
        for p, c, size in zip(pool, canon, sizes):
            for k in range(0, int(size), row):
                assert int(c) + k not in got
                got[int(c) + k] = int(p) + k
    want = {}
    for c in range(n):
        for layer in range(1, layers):
            for plane in range(planes):
                for t in range(chunk):
                    canon = int(shards[c]) + (((layer * planes + plane) * chunk) + t) * row
                    page = pages[c * ppc + t // page_size]
                    want[canon] = int(bases[layer * planes + plane]) + page * page_size * row \
                        + (t % page_size) * row
    assert got == want
    if ppc > 1:
        assert len(runs[0][2]) < n * planes * ppc, "consecutive pages were not merged"
