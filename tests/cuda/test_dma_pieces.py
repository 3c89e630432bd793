"""kvd.cuda.dma's piece lists against a plain loop over (layer, chunk, plane, page), no GPU.

Every byte a merged and split list copies must be exactly the bytes of the
page-by-page reference (same pool address for the same host address), no
entry may span two layers or two registered host pieces, layers come in
order, and merging happens where page ids run on.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.cuda import dma
from kvd_protocol.layout import LayoutDescriptor


def layout(layers=3, planes=2, pages=40, page_size=4, row=256):
    bases = tuple((0, (i * pages + 1) * page_size * row) for i in range(layers * planes))
    return LayoutDescriptor(layers, planes, pages, page_size, row, page_size * row, row, bases)


def reference(d, bases, ids, shard_ptrs, chunk_tokens):
    ppc = chunk_tokens // d.page_size
    out = []
    for layer in range(d.num_layers):
        for c, shard in enumerate(shard_ptrs):
            for k in range(d.planes):
                for j in range(ppc):
                    pool = int(bases[layer * d.planes + k]) + int(ids[c * ppc + j]) * d.page_stride
                    host = shard + ((layer * d.planes + k) * chunk_tokens + j * d.page_size) * d.row_bytes
                    out.append((layer, host, pool, d.page_size * d.row_bytes))
    return out


def expand(p, d, piece_bytes):
    """(layer, host, pool) per ``piece_bytes`` of every entry."""
    out = set()
    for layer in range(d.num_layers):
        pool, host, size = p.span(layer, layer + 1)
        for a, h, n in zip(pool.tolist(), host.tolist(), size.tolist()):
            for off in range(0, n, piece_bytes):
                out.add((layer, h + off, a + off))
    return out


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("registration", [1 << 40, 3000])
def test_pieces_cover_the_reference_exactly(consecutive, registration):
    d, chunk_tokens = layout(), 16
    rng = np.random.default_rng(int(consecutive) + registration % 7)
    ppc, n = chunk_tokens // d.page_size, 3
    ids = np.arange(n * ppc) + 5 if consecutive else rng.permutation(d.num_pages)[:n * ppc]
    bases = np.array([1 << 30 | off for _, off in d.bases], np.uint64)
    shard_bytes = d.shard_bytes(chunk_tokens)
    shard_ptrs = np.array([1 << 32, (1 << 32) + shard_bytes, (1 << 33) + 64], np.uint64)
    p = dma.pieces(d, bases, ids, shard_ptrs, chunk_tokens, (1 << 32, registration))
    piece = 64  # divides every page piece and the registration boundary (3000 is cut by bytes)
    want = {(layer, h + off, a + off) for layer, h, a, n in reference(d, bases, ids, shard_ptrs, chunk_tokens)
            for off in range(0, n, piece)}
    if registration % piece:  # a cut inside a 64-byte step: compare byte by byte instead
        want = {(layer, h + off, a + off) for layer, h, a, n in
                reference(d, bases, ids, shard_ptrs, chunk_tokens) for off in range(n)}
        piece = 1
    assert expand(p, d, piece) == want
    assert int(p.size.sum()) == n * shard_bytes
    for layer in range(d.num_layers):
        _, host, size = p.span(layer, layer + 1)
        first = (host - np.uint64(1 << 32)) // np.uint64(registration)
        last = (host + size - np.uint64(1) - np.uint64(1 << 32)) // np.uint64(registration)
        assert (first == last).all(), "an entry crosses a registered host piece"
    assert p.layer_bytes.tolist() == [n * shard_bytes // d.num_layers] * d.num_layers
    entries_per_layer = np.diff(p.starts)
    if consecutive and registration > 1 << 30:  # one entry per (chunk, plane): pages ran on
        assert entries_per_layer.tolist() == [n * d.planes] * d.num_layers
    elif not consecutive and registration > 1 << 30:
        assert entries_per_layer.min() >= n * d.planes


def test_steps_group_whole_layers():
    assert dma._steps(np.array([10, 10, 10, 10]), 25) == [2, 4]
    assert dma._steps(np.array([30, 5, 5]), 10) == [1, 3]
    assert dma._steps(np.array([1, 1]), 1) == [1, 2]


def test_eligible_only_for_pages_that_are_one_range():
    d = layout(page_size=16, row=2048)
    assert dma.eligible(d, 32 << 10) and not dma.eligible(d, 64 << 10)
    strided = LayoutDescriptor(1, 1, 8, 16, 2048, 16 * 4096, 4096, ((0, 0),))
    assert not dma.eligible(strided, 1)
