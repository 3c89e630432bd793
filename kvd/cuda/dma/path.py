"""Copy-engine-only copies: pool pages <-> the pinned arena by batched DMA, no kernel.

Why: without MPS any kernel of the daemon's costs the engine its time slice (an empty
kernel 500/s slowed a GEMM 16-20%), while batched DMA at 40-49 GB/s cost 0-3%.
``eligible`` says a pool qualifies (each page one byte range, pieces >= ``min_piece``).
``DmaQueue`` (one GPU, one direction, ``n`` streams) splits planned ops
(kvd.cuda.dma.plan) into batched driver calls, falls back op by op if refused, and never
blocks the host. ``DmaPath`` picks direct or staged (kvd.cuda.dma.stage) copies; a load is
queued in steps within ``window`` bytes, checking the cancel word before each step (a
queued DMA cannot check it), optionally from a driver thread (kvd.cuda.dma.hand).
"""


from __future__ import annotations

import time
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from kvd.cuda.dma.hand import DmaHand
from kvd.cuda.dma.plan import MIN_ROWS, CopyOps
from kvd.cuda.dma.queue import DmaQueue
from kvd.cuda.dma.stage import CeFill, chunk_pieces

DIRECT, STAGED = "DMA", "staged DMA"  # how a copy went, for the debug log
STAGE_IDLE_S = 0.05  # the other direction idle this long: a copy may go staged
MIN_ROW_BYTES = 16 << 10  # narrower rows are slow even pitched (2 KiB: 0.33 of a memcpy)
WINDOW_POLL_S = 0.0002  # a load thread waiting for its window looks again this often


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


def _queue_all(queue: DmaQueue, steps: list) -> None:
    for step in steps:
        queue.enqueue(step)


def _geometry(layout: Any, chunk_tokens: int) -> dict:
    """What ``StagingRing.run`` reads of a copy's geometry."""
    return {"planes": layout.planes, "row_bytes": layout.row_bytes, "chunk_tokens": chunk_tokens}


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
