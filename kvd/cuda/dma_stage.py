"""Staged DMA: pool pages <-> a staging slot by the copy engines inside the GPU, then
whole chunks across PCIe; no kernel.

Why: the copy engines pay about 80-100 ns per row. Pitched ops straight
between the pool and the arena move pages of 32 KiB rows at 0.82-0.90 of a
pinned memcpy and 18 KiB rows (DeepSeek-MLA) at 0.81. The same ops between
the pool and a device buffer run at 3-14x PCIe speed, so when they gather
into (scatter from) a slot of the staging ring and PCIe moves the slot as
one contiguous range, one direction reaches 0.93-0.99 (``tools/dma_probe.py``
``staged-3d``, H100). Both directions at once do worse staged (0.84-0.94
against 0.91-1.06 straight), and 2 KiB rows stay slow inside the GPU too
(0.46 of PCIe speed), so only pitched pages under ``gpu_dma_stage_below``
bytes go this way.

Contract:

- ``chunk_pieces(n_chunks, chunk_bytes, layers, slot_bytes)``: the copy as
  ``kvd.cuda.staging`` pieces ``(c0, c1, 0, layers)`` of whole chunks, as
  many as one slot holds; None when one chunk does not fit a slot.
- ``CeFill(queue, layout, groups, chunk_tokens)`` stands in for the ring's
  kernel copier in ``StagingRing.run(..., copier=fill)``: ``batch(...)``
  gives an object whose ``launch(first, count, a, b, ptr_first)`` queues the
  pitched device-to-device ops (``kvd.cuda.dma_plan.CopyOps`` with slot
  addresses for the chunks) on the ``DmaQueue``'s streams, after what the
  ring's fill stream queued so far (the slot's last DMA), and makes the fill
  stream wait for them. Whole chunks only (``a == 0``, ``b == layers``). It
  cannot read a cancel word: the caller gates loads piece by piece
  (``kvd.cuda.dma.DmaPath.load``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from kvd.cuda.dma_plan import CopyOps

_NO_SPLIT = (0, 1 << 63)  # device memory: no registration pieces to respect


def chunk_pieces(n_chunks: int, chunk_bytes: int, layers: int,
                 slot_bytes: int) -> list[tuple[int, int, int, int]] | None:
    """Pieces of whole chunks, each at most ``slot_bytes`` (module doc)."""
    per = slot_bytes // chunk_bytes
    if per < 1:
        return None
    return [(c0, min(c0 + per, n_chunks), 0, layers) for c0 in range(0, n_chunks, per)]


class CeFill:
    """One copy's fills of staging slots by the copy engines (module doc)."""

    def __init__(self, queue: Any, layout: Any, groups: list, chunk_tokens: int) -> None:
        self.queue, self.layout, self.groups, self.chunk_tokens = queue, layout, groups, chunk_tokens
        self.ppc = chunk_tokens // layout.page_size

    @contextmanager
    def batch(self, kind: str, bases: Any, page_ids: Any, ptrs: list, stream: Any, **_: Any):
        yield _Launcher(self, kind == "gather", bases, page_ids, ptrs, stream)


class _Launcher:
    def __init__(self, fill: CeFill, to_slot: bool, bases: Any, page_ids: Any, ptrs: list,
                 stream: Any) -> None:
        self.fill, self.to_slot, self.bases, self.stream = fill, to_slot, bases, stream
        self.page_ids, self.ptrs = page_ids, ptrs

    def launch(self, first: int, count: int, a: int, b: int, ptr_first: int) -> None:
        f = self.fill
        if a != 0 or b != f.layout.num_layers:
            raise ValueError("copy-engine fills move whole chunks")
        ids = self.page_ids[first * f.ppc:(first + count) * f.ppc]
        slots = self.ptrs[ptr_first:ptr_first + count]
        ops = CopyOps(f.layout, self.bases, ids, slots, f.chunk_tokens, _NO_SPLIT,
                      to_host=self.to_slot, groups=f.groups)
        f.queue.follow(self.stream)
        for step in ops.steps(1 << 62):
            self.stream.wait_event(f.queue.enqueue(step))
