"""What one DMA copy queues: pitched (3D) copy ops between pool pages and arena chunks.

Why pitched: the copy engines pay per copy, not per byte, below ~64 KiB: one
``cuMemcpyBatchAsync`` copy per (layer, plane, page) of 32 KiB pages moved
0.55-0.9 of a memcpy, 2 KiB rows 0.03-0.09. One ``cuMemcpy3DBatchAsync`` op
per page whose rows are all the (layer, plane) planes at one pitch moved the
same bytes at 0.81-0.93 (2 KiB rows: 0.33) with 1/64 as many ops
(``tools/dma_probe.py``, H100, docs/benchmarks.md).

Contract:

- ``OP_DTYPE`` is the driver's ``CUDA_MEMCPY3D_BATCH_OP`` with pointer operands
  (cuda.h, CUDA 12.8+): an array of it is what ``cuMemcpy3DBatchAsync`` reads.
- ``row_groups(bases, layers, planes)``: the pool's (layer, plane) planes as
  groups ``(first, step, count, pitch)``: planes ``first + i * step`` for
  ``i < count``, whose bases are ``pitch`` apart (``pitch > 0``; a group of one
  has pitch 0), in one allocation (``buffers``: the driver refuses an op whose
  extent spans two). Planes in order (step 1: all layers in one allocation, as
  vLLM's; a layer's K and V, as SGLang's) or plane by plane (step ``planes``),
  whichever gives fewer groups.
- ``CopyOps(layout, bases, page_ids, shard_ptrs, chunk_tokens, host_pieces)``:
  one copy of whole pages. ``ops(a, b, to_host)`` is an ``OP_DTYPE`` array that
  copies layers ``[a, b)`` and nothing else: one op per (row group, run of
  pages), where a run is pages at consecutive ids (when the pool's pages are
  adjacent) that are adjacent in the chunk too; its rows are the group's
  planes. An op is cut into single rows where its rows would overlap in the
  pool, its pitch is over ``MAX_PITCH``, or its host side would cross from one
  separately registered piece of the arena to the next (``host_pieces =
  (base, bytes)``: one copy must stay in one registration); a row that itself
  crosses is split there. ``layer_bytes`` is every layer's byte count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

OP_DTYPE = np.dtype({
    "names": ["src_type", "src", "src_pitch", "src_layer", "src_loc", "src_loc_id",
              "dst_type", "dst", "dst_pitch", "dst_layer", "dst_loc", "dst_loc_id",
              "width", "height", "depth", "order", "flags"],
    "formats": ["<i4", "<u8", "<u8", "<u8", "<i4", "<i4"] * 2 + ["<u8"] * 3 + ["<i4", "<u4"],
    "offsets": [0, 8, 16, 24, 32, 36, 40, 48, 56, 64, 72, 76, 80, 88, 96, 104, 108],
    "itemsize": 112})
OPERAND_POINTER, ORDER_STREAM = 1, 1
MAX_PITCH = 4 << 30  # 1.5, 2.5 and 4.5 GiB pitches were checked on an H100
MIN_ROWS = 16  # fewer rows go one by one: 32 KiB rows, 2/4/8 per op 0.35/0.5/0.73 of a
# memcpy, one by one 0.75, 64 per op 0.95 (H100)


def row_groups(bases: np.ndarray, layers: int, planes: int,
               buffers: list[int] | None = None) -> list[tuple[int, int, int, int]]:
    """The (layer, plane) planes as ``(first, step, count, pitch)`` groups (module doc);
    planes of different ``buffers`` (allocations) are never in one group."""
    key = [(int(buf), int(b)) for buf, b in zip(buffers or [0] * len(bases), bases)]
    in_order = _runs(key, list(range(layers * planes)), 1)
    by_plane = [g for k in range(planes)
                for g in _runs(key, list(range(k, layers * planes, planes)), planes)]
    return in_order if len(in_order) <= len(by_plane) else sorted(by_plane)


def _runs(key: list[tuple[int, int]], seq: list[int], step: int) -> list[tuple[int, int, int, int]]:
    def gap(a: int, b: int) -> int:  # pitch from plane a to plane b, 0 if they cannot share an op
        (buf_a, at_a), (buf_b, at_b) = key[a], key[b]
        return at_b - at_a if buf_a == buf_b and 0 < at_b - at_a <= MAX_PITCH else 0

    out, i = [], 0
    while i < len(seq):
        n, pitch = 1, 0
        if i + 1 < len(seq) and gap(seq[i], seq[i + 1]):
            pitch, n = gap(seq[i], seq[i + 1]), 2
            while i + n < len(seq) and gap(seq[i + n - 1], seq[i + n]) == pitch:
                n += 1
        out.append((seq[i], step, n, pitch))
        i += n
    return out


class CopyOps:
    """One copy's ops, by layers (module doc)."""

    def __init__(self, layout: Any, bases: np.ndarray, page_ids: np.ndarray,
                 shard_ptrs: np.ndarray, chunk_tokens: int, host_pieces: tuple[int, int]) -> None:
        self.planes, self.num_layers = layout.planes, layout.num_layers
        self.page_bytes = layout.page_size * layout.row_bytes
        self.plane_bytes = chunk_tokens * layout.row_bytes  # one plane of a chunk in the arena
        self.page_stride, self.bases, self.host_pieces = layout.page_stride, bases, host_pieces
        self.groups = row_groups(bases, self.num_layers, self.planes,
                                 [buf for buf, _ in layout.bases])
        ppc = chunk_tokens // layout.page_size
        ids = np.asarray(page_ids, np.int64).reshape(len(shard_ptrs), ppc)
        start = np.ones(ids.shape, bool)
        if layout.page_stride == self.page_bytes:  # pages adjacent in the pool: runs merge
            start[:, 1:] = ids[:, 1:] != ids[:, :-1] + 1
        c, j = np.nonzero(start)
        pages = np.diff(np.append(np.flatnonzero(start), ids.size))
        self.run_pool = ids[c, j].astype(np.uint64) * np.uint64(layout.page_stride)
        self.run_host = (np.asarray(shard_ptrs, np.uint64)[c]
                         + j.astype(np.uint64) * np.uint64(self.page_bytes))
        self.run_width = pages.astype(np.uint64) * np.uint64(self.page_bytes)
        self.layer_bytes = self.planes * ids.size * self.page_bytes

    def run_steps(self, most: int) -> list[slice]:
        """Consecutive groups of runs of at most ``most`` bytes over all layers (at least
        one run each), in order: a load queued in these steps keeps the ops' rows whole."""
        per_run = self.run_width * np.uint64(self.planes * self.num_layers)
        out, start, acc = [], 0, 0
        for r, n in enumerate(per_run.tolist()):
            if acc and acc + n > most:
                out.append(slice(start, r))
                start, acc = r, 0
            acc += n
        return out + [slice(start, per_run.size)]

    def ops(self, a: int, b: int, to_host: bool, runs: slice = slice(None)) -> np.ndarray:
        """Ops copying layers ``[a, b)`` of ``runs``: pool -> arena when ``to_host``, else
        back."""
        cut = self._cut(a * self.planes, b * self.planes)
        if not cut or not self.run_width[runs].size:
            return np.zeros(0, OP_DTYPE)
        first, step, count, pitch = (np.array(col, np.uint64)[:, None] for col in zip(*cut))
        pool = self.bases[first.astype(np.int64)] + self.run_pool[None, runs]
        host = first * np.uint64(self.plane_bytes) + self.run_host[None, runs]
        width = np.broadcast_to(self.run_width[None, runs], pool.shape)
        count = np.broadcast_to(count, pool.shape)
        pool_pitch = np.broadcast_to(pitch, pool.shape)
        host_pitch = np.broadcast_to(step * np.uint64(self.plane_bytes), pool.shape)
        whole = ((count == 1) | (width <= pool_pitch)) & ~self._crosses(host, host_pitch, count,
                                                                        width)
        ops = _ops(pool[whole], host[whole], width[whole], count[whole], pool_pitch[whole],
                   host_pitch[whole], to_host)
        if whole.all():
            return ops
        rows = _rows(pool[~whole], host[~whole], width[~whole], count[~whole],
                     pool_pitch[~whole], host_pitch[~whole])
        pool1, host1, width1 = _split(*rows, *self.host_pieces)
        one = np.ones(width1.size, np.uint64)
        return np.concatenate([ops, _ops(pool1, host1, width1, one, 0 * one, 0 * one, to_host)])

    def _cut(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """The row groups restricted to planes ``[lo, hi)``; groups of fewer than
        ``MIN_ROWS`` as one group per plane."""
        out = []
        for first, step, count, pitch in self.groups:
            i = max(0, -(-(lo - first) // step))
            k = min(count, -(-(hi - first) // step))
            if k - i >= MIN_ROWS:
                out.append((first + i * step, step, k - i, pitch))
            else:
                out += [(first + t * step, step, 1, 0) for t in range(i, k)]
        return out

    def _crosses(self, host, host_pitch, count, width) -> np.ndarray:
        base, piece = (np.uint64(v) for v in self.host_pieces)
        end = host + (count - np.uint64(1)) * host_pitch + width - np.uint64(1)
        return (host - base) // piece != (end - base) // piece


def _ops(pool, host, width, height, pool_pitch, host_pitch, to_host: bool) -> np.ndarray:
    ops = np.zeros(pool.size, OP_DTYPE)
    src, dst = ("host", "pool") if not to_host else ("pool", "host")
    side = {"pool": (pool, pool_pitch), "host": (host, host_pitch)}
    ops["src_type"] = ops["dst_type"] = OPERAND_POINTER
    ops["src"], ops["src_pitch"] = side[src]
    ops["dst"], ops["dst_pitch"] = side[dst]
    ops["width"], ops["height"], ops["depth"], ops["order"] = width, height, 1, ORDER_STREAM
    return ops


def rows(ops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dst, src, size)`` of every row of ``ops``: the same copies one row each."""
    return _rows(ops["dst"], ops["src"], ops["width"], ops["height"], ops["dst_pitch"],
                 ops["src_pitch"])


def _rows(pool, host, width, count, pool_pitch, host_pitch):
    """Ops of several rows as one entry per row."""
    n = count.astype(np.int64)
    i = (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)).astype(np.uint64)
    pool, host, width, pool_pitch, host_pitch = (np.repeat(x, n) for x in (
        pool, host, width, pool_pitch, host_pitch))
    return pool + i * pool_pitch, host + i * host_pitch, width


def _split(pool: np.ndarray, host: np.ndarray, size: np.ndarray, base: int, piece: int):
    """Rows cut where the host side crosses from one registered piece to the next."""
    first = (host - np.uint64(base)) // np.uint64(piece)
    last = (host + size - np.uint64(1) - np.uint64(base)) // np.uint64(piece)
    crosses = first != last
    out: list[list[int]] = [[], [], []]
    for p, h, z in zip(pool[crosses].tolist(), host[crosses].tolist(), size[crosses].tolist()):
        at, end = h, h + z
        while at < end:
            cut = min(end, base + ((at - base) // piece + 1) * piece)
            for k, v in enumerate((p + at - h, at, cut - at)):
                out[k].append(v)
            at = cut
    return tuple(np.concatenate([x[~crosses], np.array(col, np.uint64)])
                 for x, col in zip((pool, host, size), out))
