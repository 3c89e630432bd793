"""Gather and scatter between a paged KV pool and canonical chunk bytes, in numpy.

Pure functions over uint8 arrays, used by the host backend and as the
reference the GPU kernels are tested against. ``buffers`` are the pool's
registered buffers as uint8 arrays; the descriptor was validated against
their sizes, and the page ids against ``num_pages``, before any call (so
the strided views stay in bounds).

A request costs two numpy calls per (layer, plane), whatever its number of
chunks: one ``take`` of every page of the request from the pool's strided
(layer, plane) view, and one row-indexed copy between that staging buffer
and the chunks' segments in the arena. The arena is seen as rows of ``g``
bytes, ``g`` the greatest common divisor of the segment length and the
shard offsets (the allocator's alignment at least; a whole segment when
the offsets are multiples of it, the usual case), so a segment is a run of
whole rows and one index array names every segment of a (layer, plane).
The staging buffer is allocated once per request and reused.
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


class _Segments:
    """Where each chunk's (layer, plane) segment lies in the arena, as rows of ``g`` bytes."""

    def __init__(self, arena: np.ndarray, d: LayoutDescriptor, chunk_tokens: int, shard_offsets):
        self.seg = chunk_tokens * d.row_bytes  # bytes of one (layer, plane) of one shard
        offsets = np.asarray(shard_offsets, dtype=np.int64)
        self.g = int(np.gcd.reduce(offsets, initial=self.seg))
        self.rows = arena[:arena.size - arena.size % self.g].reshape(-1, self.g)
        self.per_seg = self.seg // self.g
        self.first = (offsets // self.g)[:, None] + np.arange(self.per_seg, dtype=np.int64)
        self.planes = d.planes

    def index(self, layer: int, plane: int) -> np.ndarray:
        """Row ids of every chunk's segment of (layer, plane), chunk-major."""
        return (self.first + (layer * self.planes + plane) * self.per_seg).reshape(-1)


def gather(buffers, arena, d: LayoutDescriptor, chunk_tokens: int, page_ids, shard_offsets) -> None:
    if not len(shard_offsets):
        return
    pages = np.asarray(page_ids, dtype=np.int64)
    segs = _Segments(arena, d, chunk_tokens, shard_offsets)
    staging = np.empty((pages.size, d.page_size, d.row_bytes), dtype=np.uint8)
    rows = staging.reshape(-1, segs.g)
    for layer in range(d.num_layers):
        for plane in range(d.planes):
            np.take(plane_view(buffers, d, layer, plane), pages, axis=0, out=staging, mode="clip")
            segs.rows[segs.index(layer, plane)] = rows


def scatter(buffers, arena, d: LayoutDescriptor, chunk_tokens: int, page_ids, shard_offsets,
            layers: range | None = None) -> None:
    if not len(shard_offsets):
        return
    pages = np.asarray(page_ids, dtype=np.int64)
    layers = range(d.num_layers) if layers is None else layers
    segs = _Segments(arena, d, chunk_tokens, shard_offsets)
    staging = np.empty((len(shard_offsets) * segs.per_seg, segs.g), dtype=np.uint8)
    tokens = staging.reshape(pages.size, d.page_size, d.row_bytes)
    for layer in layers:
        for plane in range(d.planes):
            np.take(segs.rows, segs.index(layer, plane), axis=0, out=staging, mode="clip")
            plane_view(buffers, d, layer, plane)[pages] = tokens
