"""Gather and scatter between a paged KV pool and canonical chunk bytes, in numpy.

Pure functions over uint8 arrays, used by the host backend and as the
reference the GPU kernels are tested against. ``buffers`` are the pool's
registered buffers as uint8 arrays; the descriptor was validated against
their sizes before any call (so the strided views stay in bounds).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvd_protocol.layout import LayoutDescriptor


def plane_view(buffers: list, d: LayoutDescriptor, layer: int, plane: int) -> np.ndarray:
    """[num_pages, page_size, row_bytes] view of one (layer, plane)."""
    buf, off = d.base(layer, plane)
    return as_strided(buffers[buf][off:], shape=(d.num_pages, d.page_size, d.row_bytes),
                      strides=(d.page_stride, d.token_stride, 1))


def shard_view(arena: np.ndarray, offset: int, d: LayoutDescriptor, chunk_tokens: int) -> np.ndarray:
    """[layer, plane, pages_per_chunk, page_size, row_bytes] view of a canonical shard."""
    ppc = chunk_tokens // d.page_size
    size = d.shard_bytes(chunk_tokens)
    return arena[offset:offset + size].reshape(d.num_layers, d.planes, ppc, d.page_size, d.row_bytes)


def gather(buffers, arena, d: LayoutDescriptor, chunk_tokens: int, page_ids, shard_offsets) -> None:
    ppc = chunk_tokens // d.page_size
    views = [[plane_view(buffers, d, l, p) for p in range(d.planes)] for l in range(d.num_layers)]
    for c, offset in enumerate(shard_offsets):
        pages = page_ids[c * ppc:(c + 1) * ppc]
        dst = shard_view(arena, offset, d, chunk_tokens)
        for layer in range(d.num_layers):
            for plane in range(d.planes):
                dst[layer, plane] = views[layer][plane][pages]


def scatter(buffers, arena, d: LayoutDescriptor, chunk_tokens: int, page_ids, shard_offsets,
            layers: range | None = None) -> None:
    ppc = chunk_tokens // d.page_size
    layers = range(d.num_layers) if layers is None else layers
    views = {(l, p): plane_view(buffers, d, l, p) for l in layers for p in range(d.planes)}
    for c, offset in enumerate(shard_offsets):
        pages = page_ids[c * ppc:(c + 1) * ppc]
        src = shard_view(arena, offset, d, chunk_tokens)
        for (layer, plane), view in views.items():
            view[pages] = src[layer, plane]
