"""Staged DMA: pool pages <-> a staging slot by device-to-device ops, then whole chunks over PCIe.

Why: pitched ops inside the GPU run at 3-14x PCIe speed, so filling a slot and moving it
as one range reaches 0.93-0.99 of a memcpy one way (0.81-0.90 straight). Off by default
(``gpu_dma_stage_below`` = 0): the driver runs these ops like kernels, costing an engine's
compute +19-23% without MPS (``kvd bench --gpu --interference``).
``chunk_pieces`` cuts a copy into whole-chunk slot pieces (None when a chunk does not
fit); ``CeFill`` stands in for the ring's kernel copier (kvd.cuda.dma.staging), queuing a
piece's ops after the slot's last DMA. It cannot read a cancel word: callers gate loads.
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
