"""The staged copy planner of kvd.cuda.dma.staging (pure functions, no GPU)."""

from __future__ import annotations

import itertools

import pytest

from kvd.cuda.dma.staging import MAX_PITCH, host_runs, plan_pieces

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



def test_piece_spans_split_exactly_at_registration_boundaries():
    from kvd.cuda.dma.staging import piece_spans
    base, piece = 1000, 64
    assert piece_spans(1000, 64, base, piece) == [(0, 64)]
    assert piece_spans(1010, 20, base, piece) == [(0, 20)]
    assert piece_spans(1060, 10, base, piece) == [(0, 4), (4, 6)]
    assert piece_spans(1060, 150, base, piece) == [(0, 4), (4, 64), (68, 64), (132, 18)]
    for addr in range(1000, 1200, 7):
        for length in (1, 5, 63, 64, 65, 200):
            spans = piece_spans(addr, length, base, piece)
            assert sum(n for _, n in spans) == length
            assert [o for o, _ in spans] == [sum(n for _, n in spans[:i]) for i in range(len(spans))]
            for off, n in spans:  # each part inside one piece
                first, last = addr + off, addr + off + n - 1
                assert (first - base) // piece == (last - base) // piece
