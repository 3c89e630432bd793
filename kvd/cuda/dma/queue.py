"""One direction of one GPU's copy-engine copies: batches of ops spread over streams.

``DmaQueue`` (taken by ``DmaPath``, kvd/cuda/dma/path.py) has ``n`` streams. ``enqueue``
splits an op array into parts of about equal bytes over them, or one stream when pieces
average ``spread_below`` bytes or more; per stream, 3D ops go as one ``cuMemcpy3DBatchAsync``
and single rows as one ``cuMemcpyBatchAsync``; a refused 3D batch is queued op by op, the
refused ones row by row (warned once). ``streams[0]`` then waits for the others, so work
queued after (layer word, done word, completion event) follows the batch. Only enqueues,
never blocks the host; keeps each batch's arrays until it landed. ``follow(stream)``
orders what comes next after ``stream``; ``idle_for()``: time since its last copy landed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from kvd.cuda.dma.plan import OP_DTYPE, Step, rows
from kvd_protocol import cuda_driver

_EVENT_NO_TIMING = 0x2
log = logging.getLogger(__name__)


class DmaQueue:
    """One direction of one GPU: batches of copies spread over ``n`` streams."""

    def __init__(self, cp: Any, n_streams: int, spread_below: int = 64 << 10) -> None:
        self.cp, self.rt = cp, cp.cuda.runtime
        self.spread_below = spread_below
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(max(1, n_streams))]
        self._joins = [self.rt.eventCreateWithFlags(_EVENT_NO_TIMING) for _ in self.streams[1:]]
        self.queued: deque = deque()  # (event, bytes, arrays) of batches not known done
        self._bytes = 0  # theirs
        self._lock = threading.Lock()  # a store queue is filled by its driver thread (dma_hand)
        self.busy_at = -1e9  # when a batch of this queue was last queued or a copy seen landed
        self.warned = False
        self._follow = self.rt.eventCreateWithFlags(_EVENT_NO_TIMING)

    @property
    def stream(self) -> Any:
        """The stream that every batch joins into."""
        return self.streams[0]

    def queued_bytes(self) -> int:
        """Bytes of the batches not known to have landed. Each batch's event is recorded
        on ``stream`` after the one before, so they land in order: only the oldest are
        queried."""
        with self._lock:
            q = self.queued
            while q and q[0][0].done:
                self._bytes -= q.popleft()[1]
            return self._bytes

    def landed(self, _future: Any = None) -> None:
        """A copy through this queue landed (a done callback of its completion future,
        which the caller polls anyway: a poller entry per batch cost every pass of the
        event loop one more query, for the staging rule alone)."""
        self.busy_at = time.monotonic()

    def idle_for(self) -> float:
        """Seconds since this queue's last copy was seen landed or was queued (0 while a
        batch is queued)."""
        return 0.0 if self.queued_bytes() else time.monotonic() - self.busy_at

    def follow(self, stream: Any, n: int | None = None) -> None:
        """What is queued on the first ``n`` (all) streams from now on runs after what
        ``stream`` has queued so far (one event, re-recorded: a wait takes its state
        when queued)."""
        self.rt.eventRecord(self._follow, stream.ptr)
        for s in self.streams[:n]:
            self.rt.streamWaitEvent(s.ptr, self._follow, 0)

    def enqueue(self, step: Step, n: int | None = None) -> Any:
        """Queue a ``dma_plan.Step`` on the first ``n`` streams (by default all, or one
        for pieces of ``spread_below`` bytes and more); returns the event recorded on
        ``stream`` after it."""
        self.queued_bytes()  # lets go of the batches that landed (a store's are never waited on)
        nbytes = step.nbytes
        if n is None and nbytes >= self.spread_below * max(1, step.ops.size + step.size.size):
            n = 1
        streams, ops = self.streams[:n], np.ascontiguousarray(step.ops)
        op_parts = _parts(ops["width"] * ops["height"], len(streams))
        row_parts = _parts(step.size, len(streams))
        keep: list = [step, ops]
        at = ops.ctypes.data
        for k, (s, o, r) in enumerate(zip(streams, op_parts, row_parts)):
            if o.stop == o.start and r.stop == r.start:
                continue
            if o.stop > o.start:  # ops o of the one array: its address + offset, no slice
                try:
                    cuda_driver.memcpy3d_batch_async(
                        s.ptr, at + o.start * OP_DTYPE.itemsize, o.stop - o.start)
                except cuda_driver.CudaExportError as exc:
                    keep.append(self._one_by_one(s.ptr, ops[o], exc))
            if r.stop > r.start:
                cuda_driver.memcpy_batch_async(s.ptr, step.dst[r], step.src[r], step.size[r])
            if k:
                self._join(k, s)
        done = self.cp.cuda.Event(block=False, disable_timing=True)
        done.record(self.stream)
        with self._lock:
            self.queued.append((done, nbytes, keep))  # what the driver reads
            self._bytes += nbytes
        self.busy_at = time.monotonic()
        return done

    def join_streams(self) -> None:
        """``stream`` waits for everything queued on the others so far (after a step
        failed part-way, before its joins)."""
        for k, s in enumerate(self.streams[1:], 1):
            self._join(k, s)

    def _join(self, k: int, s: Any) -> None:
        """``stream`` waits for what ``s`` (``streams[k]``) has queued so far."""
        self.rt.eventRecord(self._joins[k - 1], s.ptr)
        self.rt.streamWaitEvent(self.stream.ptr, self._joins[k - 1], 0)

    def _one_by_one(self, stream: int, multi: np.ndarray, exc: Exception) -> tuple:
        """After the driver refused a 3D batch: each op alone, and the refused ones as
        rows (a refused call queues nothing); returns the rows' arrays. Logged once per
        queue."""
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
        dst, src, size = rows(multi[refused])
        cuda_driver.memcpy_batch_async(stream, dst, src, size)
        return dst, src, size

    def close(self) -> None:
        """Free the events; the caller synchronized the streams."""
        for ev in [*self._joins, self._follow]:
            self.rt.eventDestroy(ev)
        self.queued, self._bytes = deque(), 0


def _parts(nbytes: np.ndarray, n: int) -> list[slice]:
    """``n`` consecutive slices of about equal bytes."""
    if nbytes.size <= 1 or n == 1:
        return [slice(0, nbytes.size)] + [slice(nbytes.size, nbytes.size)] * (n - 1)
    cum = np.cumsum(nbytes)
    bounds = [0, *np.searchsorted(cum, np.arange(1, n) * (cum[-1] / n)).tolist(), nbytes.size]
    return [slice(bounds[k], bounds[k + 1]) for k in range(n)]
