"""Copy-engine-only copies: pool pages <-> the pinned arena by batched DMA, no kernel.

Why: without CUDA MPS, the engine's and the daemon's contexts share the GPU's
SMs by time slices, and *any* kernel of the daemon's context costs the
engine its slice: an empty kernel 500 times a second slowed a concurrent
8192^3 GEMM by 16-20% on an H100, as much as kvd's copy kernels did, while
batched DMA at 40-49 GB/s cost 0-3% (``tools/interference_probe.py``,
docs/benchmarks.md). DMA runs on the copy engines, outside the time slices.

Contract:

- ``eligible(layout, min_piece, bases)``: a pool can be copied this way when
  each (layer, plane, page) of it is one byte range (a page's token rows are
  adjacent and whole) and one copy moves at least ``min_piece`` bytes: a page
  of that size, or pages of at least ``MIN_ROW_BYTES`` whose planes all sit
  in pitched groups of at least ``MIN_ROWS`` (one allocation for all layers).
  Smaller copies are slow on the copy engines (32 KiB one by one: 0.5-0.75 of
  a memcpy; 2 KiB rows: 0.3 even pitched), so they stay with the kernels.
- What a copy queues is ``kvd.cuda.dma_plan.CopyOps``: pitched ops, one per
  run of pages and group of planes at one pitch, cut by layers.
- ``DmaQueue`` is one direction of one GPU: ``n`` streams. ``enqueue`` splits
  an op array into ``n`` parts of about equal bytes; per stream, the ops of
  several rows go as one ``cuMemcpy3DBatchAsync`` and single rows as one
  ``cuMemcpyBatchAsync`` (a one-row 3D op is slow). Should the driver refuse
  a 3D batch, each op is queued alone and the refused ones row by row (a
  refused call queues nothing; warned once per queue). Then ``streams[0]``
  waits for the others (events), so work queued on ``streams[0]`` afterwards
  (a layer word, the done word, the completion event) follows the whole
  batch. It only enqueues; it keeps each batch's arrays until the next
  ``enqueue`` after the batch finished (the caller polls), and never blocks
  the host.
- Unlike a kernel, a queued DMA cannot check a load's cancel word when it
  starts: ``DmaPath.load`` therefore queues a load in steps (runs of pages of
  about a quarter of ``window`` over all layers; a layer-wise load layer by
  layer), reads the cancel word on the host before each step, and keeps at
  most ``window`` bytes queued.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvd.cuda.dma_plan import MIN_ROWS, CopyOps, Step, row_groups, rows
from kvd_protocol import cuda_driver

_EVENT_NO_TIMING = 0x2
MIN_ROW_BYTES = 16 << 10  # narrower rows are slow even pitched (2 KiB: 0.33 of a memcpy)
log = logging.getLogger(__name__)


def eligible(layout: Any, min_piece: int, bases: np.ndarray | None = None) -> bool:
    """Whether every (layer, plane, page) of ``layout`` is one byte range, and each copy
    of a page moves at least ``min_piece`` bytes: a page, or with ``bases`` a page's
    rows in pitched ops of at least MIN_ROWS planes at one pitch (rows >= 16 KiB)."""
    page = layout.page_size * layout.row_bytes
    if layout.heads != 1 or not (layout.page_size == 1 or layout.token_stride == layout.row_bytes):
        return False
    if page >= min_piece:
        return True
    if bases is None or page < MIN_ROW_BYTES:
        return False
    groups = row_groups(bases, layout.num_layers, layout.planes, [b for b, _ in layout.bases])
    rows_per_op = min(n for _, _, n, _ in groups)
    return rows_per_op >= MIN_ROWS and page * rows_per_op >= min_piece


class DmaQueue:
    """One direction of one GPU: batches of copies spread over ``n`` streams."""

    def __init__(self, cp: Any, n_streams: int) -> None:
        self.cp, self.rt = cp, cp.cuda.runtime
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(max(1, n_streams))]
        self._joins = [self.rt.eventCreateWithFlags(_EVENT_NO_TIMING) for _ in self.streams[1:]]
        self.queued: list = []  # (event, bytes, arrays) of batches not known to be done
        self.warned = False

    @property
    def stream(self) -> Any:
        """The stream that every batch joins into."""
        return self.streams[0]

    def queued_bytes(self) -> int:
        self.queued = [q for q in self.queued if not q[0].done]
        return sum(q[1] for q in self.queued)

    def enqueue(self, step: Step) -> Any:
        """Queue a ``dma_plan.Step``; returns the event recorded on ``stream`` after it."""
        n = len(self.streams)
        op_parts, row_parts = _parts(step.ops["width"] * step.ops["height"], n), _parts(step.size, n)
        keep: list = [step]
        for k, s in enumerate(self.streams):
            ops, rows_at = step.ops[op_parts[k]], row_parts[k]
            if not ops.size and rows_at.stop <= rows_at.start:
                continue
            dst, src, size = step.dst[rows_at], step.src[rows_at], step.size[rows_at]
            if ops.size:
                try:
                    cuda_driver.memcpy3d_batch_async(s.ptr, ops.ctypes.data, ops.size)
                except cuda_driver.CudaExportError as exc:
                    dst, src, size = (np.concatenate(pair) for pair in zip(
                        (dst, src, size), self._one_by_one(s.ptr, ops, exc)))
                    keep.append((dst, src, size))
            cuda_driver.memcpy_batch_async(s.ptr, dst, src, size)
            if k:
                self.rt.eventRecord(self._joins[k - 1], s.ptr)
                self.rt.streamWaitEvent(self.stream.ptr, self._joins[k - 1], 0)
        done = self.cp.cuda.Event(block=False, disable_timing=True)
        done.record(self.stream)
        self.queued.append((done, step.nbytes, keep))  # what the driver reads
        return done

    def _one_by_one(self, stream: int, multi: np.ndarray, exc: Exception) -> tuple:
        """After the driver refused a 3D batch: each op alone, and the refused ones as
        rows (a refused call queues nothing). Logged once per queue."""
        refused = []
        for i in range(multi.size):
            try:
                cuda_driver.memcpy3d_batch_async(stream, multi[i:i + 1].ctypes.data, 1)
            except cuda_driver.CudaExportError:
                refused.append(i)
        if not self.warned:
            self.warned = True
            log.warning("DMA: the driver refused pitched copies (%s), e.g. %s; %d of %d ops "
                        "go row by row", exc, multi[refused[0]] if refused else None,
                        len(refused), multi.size)
        return rows(multi[refused])

    def close(self) -> None:
        """Free the events; the caller synchronized the streams."""
        for ev in self._joins:
            self.rt.eventDestroy(ev)
        self.queued = []


def _parts(nbytes: np.ndarray, n: int) -> list[slice]:
    """``n`` consecutive slices of about equal bytes."""
    if not nbytes.size:
        return [slice(0, 0)] * n
    cuts = np.searchsorted(np.cumsum(nbytes), np.linspace(0, int(nbytes.sum()), n + 1)[1:-1])
    bounds = [0, *cuts.tolist(), nbytes.size]
    return [slice(bounds[k], bounds[k + 1]) for k in range(n)]


class DmaPath:
    """Stores and loads of one GPU by DMA only; loads gated on their cancel word."""

    def __init__(self, cp: Any, ordinal: int, n_streams: int, window: int,
                 host_pieces: tuple[int, int], poller: Any) -> None:
        self.cp, self.ordinal = cp, ordinal
        self.store_queue, self.load_queue = DmaQueue(cp, n_streams), DmaQueue(cp, n_streams)
        self.window, self.host_pieces, self.poller = window, host_pieces, poller

    def store(self, layout: Any, bases: np.ndarray, page_ids: np.ndarray, ptrs: np.ndarray,
              chunk_tokens: int) -> Any:
        """Queue a whole store (pool -> arena); returns the stream it ends on."""
        c = CopyOps(layout, bases, page_ids, ptrs, chunk_tokens, self.host_pieces, to_host=True)
        for step in c.steps(1 << 62):
            self.store_queue.enqueue(step)
        return self.store_queue.stream

    async def load(self, layout: Any, bases: np.ndarray, page_ids: np.ndarray, ptrs: np.ndarray,
                   chunk_tokens: int, signal: Any) -> Any:
        """Queue a load (arena -> pool) in steps, each after the host found the load not
        cancelled and at most ``window`` bytes queued: runs of pages of about ``window /
        4`` bytes over all layers (ops of many rows), or for a layer-wise ``signal`` one
        layer at a time, each layer's word behind that layer. Returns the stream it ends
        on (the caller writes the done word there, also after a cancel or an error)."""
        q, layerwise = self.load_queue, signal is not None and signal.layerwise
        c = CopyOps(layout, bases, page_ids, ptrs, chunk_tokens, self.host_pieces, to_host=False,
                    by_layer=layerwise)
        for layer, step in enumerate(c.steps(max(1, self.window // 4))):
            while q.queued_bytes() > self.window:
                await self.poller.wait(q.queued[0][0])
            if signal is not None and signal.source.cancelled:
                break  # what is queued runs; nothing more touches the pages
            with self.cp.cuda.Device(self.ordinal):  # not held across the await above
                q.enqueue(step)
                if layerwise:
                    signal.layers_landed(q.stream, (layer,))
        return q.stream

    def close(self) -> None:
        self.store_queue.close()
        self.load_queue.close()
