"""Copy-engine-only copies: pool pages <-> the pinned arena by batched DMA, no kernel.

Why: without CUDA MPS, the engine's and the daemon's contexts share the GPU's
SMs by time slices, and *any* kernel of the daemon's context costs the
engine its slice: an empty kernel 500 times a second slowed a concurrent
8192^3 GEMM by 16-20% on an H100, as much as kvd's copy kernels did, while
batched DMA at 40-49 GB/s cost 0-3% (``tools/probes/interference_probe.py``,
docs/benchmarks.md in git history). DMA runs on the copy engines, outside the time slices.

Contract:

- ``eligible(layout, min_piece, groups)``: a pool can be copied this way when
  each (layer, plane, page) of it is one byte range (a page's token rows are
  adjacent and whole) and one copy moves at least ``min_piece`` bytes: a page
  of that size, or pages of at least ``MIN_ROW_BYTES`` whose planes all sit
  in pitched groups of at least ``MIN_ROWS`` (one allocation for all layers;
  ``groups`` is ``dma_plan.pool_groups``, computed once per pool).
  Smaller copies are slow on the copy engines (32 KiB one by one: 0.5-0.75 of
  a memcpy; 2 KiB rows: 0.3 even pitched), so they stay with the kernels.
- What a copy queues is ``kvd.cuda.dma.plan.CopyOps``: pitched ops, one per
  run of pages and group of planes at one pitch, cut by layers.
- ``DmaQueue`` is one direction of one GPU: ``n`` streams. ``enqueue`` splits
  an op array into ``n`` (or fewer, when asked) parts of about equal bytes,
  or queues it on one stream when its pieces (ops and single rows) average
  ``spread_below`` bytes or more (large pieces keep up with PCIe on one
  stream, and spread they lost both-ways throughput); per stream, the ops of
  several rows go as one ``cuMemcpy3DBatchAsync`` (a range of the step's
  one contiguous op array, passed by address) and single rows as one
  ``cuMemcpyBatchAsync`` (a one-row 3D op is slow). Should the driver refuse
  a 3D batch, each op is queued alone and the refused ones row by row (a
  refused call queues nothing; warned once per queue). Then ``streams[0]``
  waits for the others (events), so work queued on ``streams[0]`` afterwards
  (a layer word, the done word, the completion event) follows the whole
  batch. It only enqueues, and never blocks the host; it keeps each batch's
  arrays (what the driver reads) until the next ``enqueue`` or
  ``queued_bytes`` after the batch landed. Batches land in order, so
  ``queued_bytes`` queries the oldest only. ``follow(stream)`` orders what
  is queued next after ``stream``'s work so far; ``idle_for()`` is how long
  ago its last copy landed (``landed``: the caller's completion future calls
  it; a batch adds no query to the event loop's polling).
- ``DmaPath`` (one GPU; ``DmaSettings`` are the ``gpu_dma_*`` knobs): a copy
  goes straight (the ops above) or, where ``staged`` says so (pitched pages
  under ``stage_below`` bytes, whole chunks fit a slot, the other direction
  idle for ``STAGE_IDLE_S``), through the staging ring with
  ``kvd.cuda.dma.stage.CeFill`` in place of the kernels. ``store`` returns
  the stream the copy ends on, how it went (``DIRECT`` or ``STAGED``) and
  None; with ``store_thread`` (``gpu_dma_store_thread``) the loop only plans
  a store, ``kvd.cuda.dma.hand`` queues it, and ``store`` returns None, how,
  and its ``Handed`` to poll (not with ``stage_below``: the thread owns the
  store queue's streams, which the staging slots' fills share);
  ``load`` returns how it went (it ends on ``load_queue.stream``) and what
  is left to queue (below); with ``load_thread`` (``gpu_dma_load_thread``,
  not with ``stage_below`` either) the caller uses ``hand_load`` instead.
- Unlike a kernel, a queued DMA cannot check a load's cancel word when it
  starts: ``DmaPath.load`` therefore queues a load in steps (a staging slot's
  chunks; runs of pages of about a quarter of ``window`` over all layers; a
  layer-wise load layer by layer, never staged), reads the cancel word on
  the host before each step, and keeps at most ``window`` bytes queued. The
  steps the window admits go in the caller's turn, before ``load`` returns
  (a task started for them began a loop turn later, each turn possibly
  behind a whole store); ``load`` returns the rest as a coroutine function,
  or None when nothing is left to queue. ``hand_load`` plans the same steps
  on the loop and hands them to the load queue's thread, which checks the
  cancel word and the window (polling every ``WINDOW_POLL_S``) before each
  step and writes the layer words and then the done word (also after a
  cancel or an error); it returns the ``Handed`` to poll.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from kvd.cuda.dma.hand import DmaHand
from kvd.cuda.dma.plan import MIN_ROWS, OP_DTYPE, CopyOps, Step, rows
from kvd.cuda.dma.stage import CeFill, chunk_pieces
from kvd_protocol import cuda_driver

_EVENT_NO_TIMING = 0x2
DIRECT, STAGED = "DMA", "staged DMA"  # how a copy went, for the debug log
STAGE_IDLE_S = 0.05  # the other direction idle this long: a copy may go staged
MIN_ROW_BYTES = 16 << 10  # narrower rows are slow even pitched (2 KiB: 0.33 of a memcpy)
WINDOW_POLL_S = 0.0002  # a load thread waiting for its window looks again this often
log = logging.getLogger(__name__)


def eligible(layout: Any, min_piece: int, groups: list | None = None) -> bool:
    """Whether every (layer, plane, page) of ``layout`` is one byte range, and each copy
    of a page moves at least ``min_piece`` bytes: a page, or with the pool's ``groups``
    (``dma_plan.pool_groups``) a page's rows in pitched ops of at least MIN_ROWS planes
    at one pitch (rows >= 16 KiB)."""
    page = layout.page_size * layout.row_bytes
    if layout.heads != 1 or not (layout.page_size == 1 or layout.token_stride == layout.row_bytes):
        return False
    if page >= min_piece:
        return True
    if groups is None or page < MIN_ROW_BYTES:
        return False
    return pitched(groups) and page * min(n for _, _, n, _ in groups) >= min_piece


def pitched(groups: list) -> bool:
    """Whether every group of planes is copied as pitched ops (at least MIN_ROWS rows)."""
    return min(n for _, _, n, _ in groups) >= MIN_ROWS


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


def _queue_all(queue: DmaQueue, steps: list) -> None:
    for step in steps:
        queue.enqueue(step)


def _geometry(layout: Any, chunk_tokens: int) -> dict:
    """What ``StagingRing.run`` reads of a copy's geometry."""
    return {"planes": layout.planes, "row_bytes": layout.row_bytes, "chunk_tokens": chunk_tokens}


def _parts(nbytes: np.ndarray, n: int) -> list[slice]:
    """``n`` consecutive slices of about equal bytes."""
    if nbytes.size <= 1 or n == 1:
        return [slice(0, nbytes.size)] + [slice(nbytes.size, nbytes.size)] * (n - 1)
    cum = np.cumsum(nbytes)
    bounds = [0, *np.searchsorted(cum, np.arange(1, n) * (cum[-1] / n)).tolist(), nbytes.size]
    return [slice(bounds[k], bounds[k + 1]) for k in range(n)]


class DmaSettings(NamedTuple):
    """The ``gpu_dma_*`` knobs (kvd.config has their help)."""
    streams: int = 8
    min_piece: int = 64 << 10
    load_window: int = 256 << 20
    stage_below: int = 0
    spread_below: int = 64 << 10
    store_thread: bool = True
    load_thread: bool = True


class DmaPath:
    """Stores and loads of one GPU by DMA only; loads gated on their cancel word."""

    def __init__(self, cp: Any, ordinal: int, settings: DmaSettings, host_pieces: tuple[int, int],
                 poller: Any, rings: tuple = (None, None)) -> None:
        self.cp, self.ordinal = cp, ordinal
        self.store_queue, self.load_queue = (DmaQueue(cp, settings.streams, settings.spread_below)
                                             for _ in range(2))
        self.window, self.host_pieces, self.poller = settings.load_window, host_pieces, poller
        self.rings, self.stage_below = rings, settings.stage_below
        self.store_hand, self.load_hand = (
            DmaHand(cp, ordinal, q, f"kvd-dma{ordinal}{suffix}") if on and not self.stage_below
            else None for q, suffix, on in ((self.store_queue, "", settings.store_thread),
                                            (self.load_queue, "-load", settings.load_thread)))

    def staged(self, ring: Any, other: DmaQueue, layout: Any, groups: list, chunk_tokens: int,
               n_chunks: int) -> list | None:
        """The staging pieces of a copy that goes through ``ring`` (pitched pages under
        ``stage_below`` bytes, whole chunks fit a slot, the ``other`` way idle for
        ``STAGE_IDLE_S``: both ways at once, straight ops are faster, and a mix flip-flops),
        else None."""
        if ring is None or not n_chunks or layout.page_size * layout.row_bytes >= self.stage_below \
                or not pitched(groups) or other.idle_for() < STAGE_IDLE_S:
            return None
        return chunk_pieces(n_chunks, layout.shard_bytes(chunk_tokens), layout.num_layers,
                            ring.slot_bytes)

    def _through(self, ring: Any, queue: DmaQueue, pieces: list, layout: Any, bases: np.ndarray,
                 groups: list, page_ids: np.ndarray, ptrs: np.ndarray, chunk_tokens: int) -> Any:
        """``run(some_pieces)``: those pieces of a staged copy through ``ring``, its slots
        filled or emptied by the copy engines on ``queue`` (``dma_stage.CeFill``)."""
        fill = CeFill(queue, layout, bases, groups, page_ids, pieces, chunk_tokens,
                      to_slot=ring.kind == "gather")
        geometry, host = _geometry(layout, chunk_tokens), [int(p) for p in ptrs]
        return partial(ring.run, bases=bases, page_ids=page_ids, shard_ptrs=host,
                       geometry=geometry, copier=fill)

    def store(self, layout: Any, bases: np.ndarray, groups: list, page_ids: np.ndarray,
              ptrs: np.ndarray, chunk_tokens: int) -> Any:
        """Queue a whole store (pool -> arena); returns ``(stream, how, None)``: the stream
        it ends on and how, or with ``store_thread`` ``(None, how, handed)``: the thread
        queues it, ``handed`` (``dma_hand.Handed``) is what to poll."""
        ring = self.rings[0]
        pieces = self.staged(ring, self.load_queue, layout, groups, chunk_tokens, len(ptrs))
        if pieces is not None:
            run = self._through(ring, self.store_queue, pieces, layout, bases, groups, page_ids,
                                ptrs, chunk_tokens)
            return run(pieces), STAGED, None
        c = CopyOps(layout, bases, page_ids, ptrs, chunk_tokens, self.host_pieces, to_host=True,
                    groups=groups)
        queue_all = partial(_queue_all, self.store_queue, c.steps(1 << 62))
        if self.store_hand is not None:
            return None, DIRECT, self.store_hand.hand(queue_all)
        queue_all()
        return self.store_queue.stream, DIRECT, None

    def load(self, layout: Any, bases: np.ndarray, groups: list, page_ids: np.ndarray,
             ptrs: np.ndarray, chunk_tokens: int, signal: Any) -> tuple[str, Any]:
        """Queue a load (arena -> pool) in steps, each after the host found the load not
        cancelled and at most ``window`` bytes queued: staging pieces (``staged``), or
        runs of pages of about ``window / 4`` bytes over all layers (ops of many rows),
        or for a layer-wise ``signal`` one layer at a time, each layer's word behind that
        layer. The steps the window admits now are queued before it returns (no loop
        turn between a load's turn and its copy); returns how it went and ``rest``: None
        once nothing is left to queue, else a coroutine function that queues the other
        steps as the window lets them. Everything it queues ends on
        ``load_queue.stream`` (the caller writes the done word there, also after a
        cancel or an error)."""
        q, layerwise, ring = self.load_queue, signal is not None and signal.layerwise, self.rings[1]
        pieces = None if layerwise else self.staged(ring, self.store_queue, layout, groups,
                                                    chunk_tokens, len(ptrs))
        if pieces is not None:
            run = self._through(ring, q, pieces, layout, bases, groups, page_ids, ptrs,
                                chunk_tokens)
            steps = [partial(run, [p]) for p in pieces]
        else:
            steps = self._load_steps(layout, bases, groups, page_ids, ptrs, chunk_tokens, layerwise)
        how = DIRECT if pieces is None else STAGED
        todo = iter(enumerate(steps))
        queue_one = partial(self._load_step, signal, layerwise)
        while q.queued_bytes() <= self.window:
            if not queue_one(next(todo, None)):
                return how, None

        async def rest() -> None:
            while True:
                while q.queued_bytes() > self.window:
                    await self.poller.wait(q.queued[0][0])
                if not queue_one(next(todo, None)):
                    return
        return how, rest

    def hand_load(self, layout: Any, bases: np.ndarray, groups: list, page_ids: np.ndarray,
                  ptrs: np.ndarray, chunk_tokens: int, signal: Any) -> Any:
        """``load`` with ``load_thread``: the steps planned here, queued by the load queue's
        thread (each after the cancel word and the window), the done word behind them;
        returns the ``dma_hand.Handed`` to poll."""
        q, layerwise = self.load_queue, signal is not None and signal.layerwise
        steps = enumerate(self._load_steps(layout, bases, groups, page_ids, ptrs, chunk_tokens,
                                           layerwise))

        def work() -> None:
            for item in steps:
                while q.queued_bytes() > self.window:
                    time.sleep(WINDOW_POLL_S)
                if not self._load_step(signal, layerwise, item):
                    return
        return self.load_hand.hand(work, None if signal is None else partial(signal.done, q.stream))

    def _load_steps(self, layout: Any, bases: np.ndarray, groups: list, page_ids: np.ndarray,
                    ptrs: np.ndarray, chunk_tokens: int, layerwise: bool) -> list:
        """A straight load's steps: runs of pages of about ``window / 4`` bytes, or layers."""
        c = CopyOps(layout, bases, page_ids, ptrs, chunk_tokens, self.host_pieces, to_host=False,
                    by_layer=layerwise, groups=groups)
        return [partial(self.load_queue.enqueue, step) for step in c.steps(max(1, self.window // 4))]

    def _load_step(self, signal: Any, layerwise: bool, item: tuple | None) -> bool:
        """Queue one (layer, step) of a load unless there is none or the load was
        cancelled (what is queued runs; nothing more touches the pages); whether it did."""
        if item is None or (signal is not None and signal.source.cancelled):
            return False
        layer, step = item
        with self.cp.cuda.Device(self.ordinal):  # never held across an await
            step()
            if layerwise:
                signal.layers_landed(self.load_queue.stream, (layer,))
        return True

    @property
    def streams(self) -> list:
        """Every stream of both queues."""
        return self.store_queue.streams + self.load_queue.streams

    def settle(self, timeout: float | None = None) -> bool:
        """Let the threads queue what they were handed, and stop them (before the streams
        are synchronized at shutdown); False if one is still in a driver call or waiting for
        its window after ``timeout`` seconds (in all)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for hand in filter(None, (self.store_hand, self.load_hand)):
            if not hand.close(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True

    def close(self) -> None:
        self.settle()
        self.store_queue.close()
        self.load_queue.close()
