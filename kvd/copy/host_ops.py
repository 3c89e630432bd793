"""Gather and scatter between a paged KV pool and canonical chunk bytes, in numpy.

Pure functions over uint8 arrays; the host backend's copies and the reference the GPU
kernels are tested against. Callers validated the descriptor and page ids first, so the
strided views stay in bounds. Promises: numpy calls per request grow with (layer, plane)
pairs and MiB moved, never with the chunk count alone; canonical rows are a row's head
pieces back to back (kvd_protocol.layout); a scatter leaves out pages of id ``SKIP_PAGE``
(a partial load). Never calls ``np.take`` on a strided pool view (it would copy it first).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvd_protocol.layout import LayoutDescriptor

BLOCK_BYTES = 1 << 20
PAGE_COPY_MIN = 256 << 10  # below it, the per-(layer, plane) loop moves more per numpy call


def row_dims(d: LayoutDescriptor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and byte strides of one token row: ``(row_bytes,)``, or ``(heads, piece)``."""
    if d.heads == 1:
        return (d.row_bytes,), (1,)
    return (d.heads, d.piece_bytes), (d.head_stride, 1)


def plane_view(buffers: list, d: LayoutDescriptor, layer: int, plane: int) -> np.ndarray:
    """[num_pages, page_size, *row] view of one (layer, plane)."""
    buf, off = d.base(layer, plane)
    shape, strides = row_dims(d)
    return as_strided(buffers[buf][off:], shape=(d.num_pages, d.page_size, *shape),
                      strides=(d.page_stride, d.token_stride, *strides))


def pool_view(buffers: list, d: LayoutDescriptor) -> np.ndarray | None:
    """[layer, plane, num_pages, page_size, *row] view of the whole pool, when every
    (layer, plane) base lies in one buffer at ``first + layer * a + plane * b`` (a, b >= 0);
    else None."""
    buf, first = d.bases[0]
    a = d.base(1, 0)[1] - first if d.num_layers > 1 else 0
    b = d.base(0, 1)[1] - first if d.planes > 1 else 0
    if a < 0 or b < 0 or any(d.base(layer, plane) != (buf, first + layer * a + plane * b)
                             for layer in range(d.num_layers) for plane in range(d.planes)):
        return None
    shape, strides = row_dims(d)
    return as_strided(buffers[buf][first:], shape=(d.num_layers, d.planes, d.num_pages,
                                                   d.page_size, *shape),
                      strides=(a, b, d.page_stride, d.token_stride, *strides))


def shard_view(arena: np.ndarray, offset: int, d: LayoutDescriptor, chunk_tokens: int) -> np.ndarray:
    """[layer, plane, pages_per_chunk, page_size, *row] view of a canonical shard."""
    ppc = chunk_tokens // d.page_size
    size = d.shard_bytes(chunk_tokens)
    return arena[offset:offset + size].reshape(d.num_layers, d.planes, ppc, d.page_size,
                                               *row_dims(d)[0])


class _Segments:
    """Where each chunk's (layer, plane) segment lies in the arena, as rows of ``g`` bytes,
    and how many chunks one copy takes (``per``: about ``BLOCK_BYTES``)."""

    def __init__(self, arena: np.ndarray, d: LayoutDescriptor, chunk_tokens: int, shard_offsets):
        self.seg = chunk_tokens * d.row_bytes  # bytes of one (layer, plane) of one shard
        offsets = np.asarray(shard_offsets, dtype=np.int64)
        self.g = int(np.gcd.reduce(offsets, initial=self.seg))
        self.rows = arena[:arena.size - arena.size % self.g].reshape(-1, self.g)
        self.per_seg = self.seg // self.g
        self.first = (offsets // self.g)[:, None] + np.arange(self.per_seg, dtype=np.int64)
        self.planes = d.planes
        self.chunks = len(offsets)
        self.per = max(1, BLOCK_BYTES // self.seg)

    def blocks(self, layer: int, plane: int):
        """(first chunk, row ids of the segments of (layer, plane) of the next ``per``
        chunks), chunk-major."""
        rows = (self.first + (layer * self.planes + plane) * self.per_seg).reshape(-1)
        for c in range(0, self.chunks, self.per):
            yield c, rows[c * self.per_seg:(c + self.per) * self.per_seg]


def gather(buffers, arena, d: LayoutDescriptor, chunk_tokens: int, page_ids, shard_offsets) -> None:
    if not len(shard_offsets):
        return
    pages = np.asarray(page_ids, dtype=np.int64)
    ppc = chunk_tokens // d.page_size
    whole = pool_view(buffers, d) if _by_page(d, d.num_layers) else None
    if whole is not None:
        for c, offset in enumerate(shard_offsets):
            dst = shard_view(arena, offset, d, chunk_tokens)
            for j, page in enumerate(pages[c * ppc:(c + 1) * ppc]):
                dst[:, :, j] = whole[:, :, page]
        return
    segs = _Segments(arena, d, chunk_tokens, shard_offsets)
    for layer in range(d.num_layers):
        for plane in range(d.planes):
            view = plane_view(buffers, d, layer, plane)
            for c, rows in segs.blocks(layer, plane):
                segs.rows[rows] = view[pages[c * ppc:(c + segs.per) * ppc]].reshape(-1, segs.g)


def scatter(buffers, arena, d: LayoutDescriptor, chunk_tokens: int, page_ids, shard_offsets,
            layers: range | None = None) -> None:
    if not len(shard_offsets):
        return
    pages = np.asarray(page_ids, dtype=np.int64)
    ppc = chunk_tokens // d.page_size
    layers = range(d.num_layers) if layers is None else layers
    whole = pool_view(buffers, d) if _by_page(d, len(layers)) else None
    if whole is not None:
        span = slice(layers.start, layers.stop)
        for c, offset in enumerate(shard_offsets):
            src = shard_view(arena, offset, d, chunk_tokens)[span]
            for j, page in enumerate(pages[c * ppc:(c + 1) * ppc]):
                if page >= 0:  # SKIP_PAGE: a partial load's tail
                    whole[span, :, page] = src[:, :, j]
        return
    segs = _Segments(arena, d, chunk_tokens, shard_offsets)
    staging = np.empty((min(segs.per, segs.chunks) * segs.per_seg, segs.g), dtype=np.uint8)
    for layer in layers:
        for plane in range(d.planes):
            view = plane_view(buffers, d, layer, plane)
            for c, rows in segs.blocks(layer, plane):
                part = staging[:rows.size]
                np.take(segs.rows, rows, axis=0, out=part, mode="clip")
                _put(view, pages[c * ppc:(c + segs.per) * ppc],
                     part.reshape(-1, d.page_size, *row_dims(d)[0]))


def _by_page(d: LayoutDescriptor, layers: int) -> bool:
    """Copy page by page through one view of the whole pool when a page (of ``layers``)
    moves at least ``PAGE_COPY_MIN``: a plain slice copies strided rows in one pass, where a
    fancy index costs a second, and the calls grow with the MiB moved."""
    return layers * d.planes * d.page_size * d.row_bytes >= PAGE_COPY_MIN


def _put(view: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """``view[ids] = rows``, leaving out the pages of ``SKIP_PAGE`` ids (negative)."""
    keep = ids >= 0
    if keep.all():
        view[ids] = rows
    else:
        view[ids[keep]] = rows[keep]
