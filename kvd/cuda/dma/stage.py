"""Staged DMA: pool pages <-> a staging slot by device-to-device DMA ops, then
whole chunks across PCIe; no kernel.

Why: the copy engines pay about 80-100 ns per row. Pitched ops straight
between the pool and the arena move pages of 32 KiB rows at 0.82-0.90 of a
pinned memcpy and 18 KiB rows (DeepSeek-MLA) at 0.81. The same ops between
the pool and a device buffer run at 3-14x PCIe speed, so when they gather
into (scatter from) a slot of the staging ring and PCIe moves the slot as
one contiguous range, one direction reaches 0.93-0.99 (``tools/probes/dma_probe.py``
``staged-3d``, H100). Both directions at once do worse staged (0.84-0.94
against 0.91-1.06 straight), and 2 KiB rows stay slow inside the GPU too
(0.46 of PCIe speed), so only pitched pages under ``gpu_dma_stage_below``
bytes go this way. Off by default (``gpu_dma_stage_below`` = 0): the driver
runs these device-to-device ops like kernels of the daemon's context, and an
engine's GEMM or decode step took +19-23% while staged copies ran without
CUDA MPS (+1-4% straight; ``kvd bench --gpu --interference``, H100).

Contract:

- ``chunk_pieces(n_chunks, chunk_bytes, layers, slot_bytes)``: the copy as
  ``kvd.cuda.dma.staging`` pieces ``(c0, c1, 0, layers)`` of whole chunks, as
  many as one slot holds; None when one chunk does not fit a slot.
- ``CeFill(queue, layout, bases, groups, page_ids, pieces, chunk_tokens,
  to_slot)`` stands in for the ring's kernel copier in
  ``StagingRing.run(..., copier=fill)``. It plans the copy's pitched
  device-to-device ops once (``kvd.cuda.dma.plan.CopyOps``, whose ops in run
  order make a piece's ops one slice; ``pieces`` from
  ``chunk_pieces``, chunk ``c`` at ``c % per_piece`` chunks from its slot's start); ``batch(...)`` gives an
  object whose ``launch(first, count, a, b, ptr_first)`` queues the ops of
  chunks ``[first, first + count)`` against the slot at ``ptrs[ptr_first]``
  on ``FILL_STREAMS`` of the ``DmaQueue``'s streams, after what the ring's fill
  stream queued so far (the slot's last DMA), and makes the fill stream wait
  for them. Whole chunks only (``a == 0``, ``b == layers``). It cannot read a
  cancel word: the caller gates loads piece by piece
  (``kvd.cuda.dma.path.DmaPath.load``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import numpy as np

from kvd.cuda.dma.plan import CopyOps, Step

_NO_SPLIT = (0, 1 << 63)  # device memory: no registration pieces to respect
FILL_STREAMS = 2  # a fill is 3-14x faster than PCIe: more streams only cost host time


def chunk_pieces(n_chunks: int, chunk_bytes: int, layers: int,
                 slot_bytes: int) -> list[tuple[int, int, int, int]] | None:
    """Pieces of whole chunks, each at most ``slot_bytes`` (module doc)."""
    per = slot_bytes // chunk_bytes
    if per < 1:
        return None
    return [(c0, min(c0 + per, n_chunks), 0, layers) for c0 in range(0, n_chunks, per)]


class CeFill:
    """One copy's fills of staging slots by the copy engines (module doc)."""

    def __init__(self, queue: Any, layout: Any, bases: np.ndarray, groups: list,
                 page_ids: np.ndarray, pieces: list, chunk_tokens: int, to_slot: bool) -> None:
        n_chunks, per_piece = pieces[-1][1], pieces[0][1] - pieces[0][0]
        at = (np.arange(n_chunks, dtype=np.uint64) % np.uint64(per_piece)) \
            * np.uint64(layout.shard_bytes(chunk_tokens))
        plan = CopyOps(layout, bases, page_ids, at, chunk_tokens, _NO_SPLIT, to_host=to_slot,
                       groups=groups)
        self.queue, self.layers, self.slot_side = queue, layout.num_layers, ("dst", "src")[not to_slot]
        self.step = plan.steps(1 << 62)[0]
        self.op_chunk = plan.run_chunk[plan.op_run.astype(np.int64)]
        self.row_chunk = plan.run_chunk[plan.rows["run"].astype(np.int64)]

    @contextmanager
    def batch(self, kind: str, bases: Any, page_ids: Any, ptrs: list, stream: Any, **_: Any):
        yield _Launcher(self, ptrs, stream)

    def piece(self, first: int, count: int, slot: int) -> Step:
        """The ops and rows of chunks ``[first, first + count)``, against ``slot``."""
        s, side = self.step, self.slot_side
        a, b = np.searchsorted(self.op_chunk, (first, first + count)).tolist()  # ops in run order
        ops = s.ops[a:b].copy()  # the slot's address goes in
        ops[side] += np.uint64(slot)
        if not s.size.size:
            return Step(ops, s.dst, s.src, s.size)
        row_at = (self.row_chunk >= first) & (self.row_chunk < first + count)
        rows = {"dst": s.dst[row_at], "src": s.src[row_at]}
        rows[side] = rows[side] + np.uint64(slot)
        return Step(ops, rows["dst"], rows["src"], s.size[row_at])


class _Launcher:
    def __init__(self, fill: CeFill, ptrs: list, stream: Any) -> None:
        self.fill, self.ptrs, self.stream = fill, ptrs, stream

    def launch(self, first: int, count: int, a: int, b: int, ptr_first: int) -> None:
        f = self.fill
        if a != 0 or b != f.layers:
            raise ValueError("copy-engine fills move whole chunks")
        step = f.piece(first, count, self.ptrs[ptr_first])
        f.queue.follow(self.stream, FILL_STREAMS)
        self.stream.wait_event(f.queue.enqueue(step, FILL_STREAMS))
