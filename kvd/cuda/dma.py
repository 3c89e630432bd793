"""Copy-engine-only copies: pool pages <-> the pinned arena by batched DMA, no kernel.

Why: without CUDA MPS, the engine's and the daemon's contexts share the GPU's
SMs by time slices, and *any* kernel of the daemon's context costs the
engine its slice: an empty kernel 500 times a second slowed a concurrent
8192^3 GEMM by 16-20% on an H100, as much as kvd's copy kernels did, while
batched DMA at 40-49 GB/s cost 0-3% (``tools/interference_probe.py``,
docs/benchmarks.md). DMA runs on the copy engines, outside the time slices.

Contract:

- ``eligible(layout, min_piece)``: a pool can be copied this way when each
  (layer, plane, page) of it is one byte range (a page's token rows are
  adjacent and whole) of at least ``min_piece`` bytes. Smaller pieces are
  slow on the copy engines (one 2 KiB page row: 0.05 of a memcpy), so they
  stay with the kernels.
- ``pieces(layout, bases, page_ids, shard_ptrs, chunk_tokens, host_pieces)``:
  a ``Pieces`` of uint64 arrays ``pool``, ``host``, ``size``, one entry per
  (layer, chunk, plane, page), layer-major, with entries of one layer
  adjacent on both sides merged into one (consecutive page ids make long
  runs), and split where the host side crosses a separately registered
  piece of the arena (``host_pieces = (base, bytes)``: one copy must stay in
  one registration); ``span(a, b)`` are layers ``[a, b)``.
- ``DmaQueue`` is one direction of one GPU: ``n`` streams. ``enqueue`` splits
  a batch into ``n`` parts of about equal bytes, one ``cuMemcpyBatchAsync``
  per stream (several copy engines at once: 32 KiB pieces reach 0.6 of a
  memcpy on one stream, 0.7-0.9 on 4-8), then makes ``streams[0]`` wait for
  the others (events), so work queued on ``streams[0]`` afterwards (a layer
  word, the done word, the completion event) follows the whole batch. It
  only enqueues; it keeps each batch's arrays until the next ``enqueue``
  after the batch finished (the caller polls), and never blocks the host.
- Unlike a kernel, a queued DMA cannot check a load's cancel word when it
  starts: ``DmaPath.load`` therefore queues a load in steps of whole layers
  (about a quarter of ``window`` each), reads the cancel word on the host
  before each step, and keeps at most ``window`` bytes queued.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvd_protocol import cuda_driver

_EVENT_NO_TIMING = 0x2


def eligible(layout: Any, min_piece: int) -> bool:
    """Whether every (layer, plane, page) of ``layout`` is one range of >= ``min_piece``."""
    if layout.heads != 1:
        return False
    dense = layout.page_size == 1 or layout.token_stride == layout.row_bytes
    return dense and layout.page_size * layout.row_bytes >= min_piece


class Pieces:
    """A copy's pieces, layer-major: ``pool``, ``host``, ``size`` (uint64 arrays) and
    ``starts`` (entry ``starts[l]`` is layer ``l``'s first; ``starts[-1]`` the total)."""

    def __init__(self, pool: np.ndarray, host: np.ndarray, size: np.ndarray, layer: np.ndarray,
                 num_layers: int) -> None:
        self.pool, self.host, self.size = pool, host, size
        self.starts = np.searchsorted(layer, np.arange(num_layers + 1))
        self.layer_bytes = np.add.reduceat(size, self.starts[:-1]) if size.size else \
            np.zeros(num_layers, np.uint64)

    def span(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(pool, host, size)`` of layers ``[a, b)``."""
        i, j = self.starts[a], self.starts[b]
        return self.pool[i:j], self.host[i:j], self.size[i:j]


def pieces(layout: Any, bases: np.ndarray, page_ids: np.ndarray, shard_ptrs: np.ndarray,
           chunk_tokens: int, host_pieces: tuple[int, int]) -> Pieces:
    """Every page piece of every layer, merged (never across layers) and split."""
    planes, size = layout.planes, layout.page_size * layout.row_bytes
    ppc, n_chunks, layers = chunk_tokens // layout.page_size, len(shard_ptrs), layout.num_layers
    lp = np.arange(layers * planes, dtype=np.uint64).reshape(layers, 1, planes, 1)  # layer*planes+k
    ids = page_ids.astype(np.uint64).reshape(1, n_chunks, 1, ppc)
    pool = bases[lp.astype(np.int64)] + ids * np.uint64(layout.page_stride)
    host = (np.asarray(shard_ptrs, np.uint64).reshape(1, -1, 1, 1)
            + (lp * np.uint64(chunk_tokens)
               + np.arange(ppc, dtype=np.uint64).reshape(1, 1, 1, -1) * np.uint64(layout.page_size))
            * np.uint64(layout.row_bytes))
    layer = np.broadcast_to(np.arange(layers).reshape(-1, 1, 1, 1), pool.shape).reshape(-1)
    merged = _merge(pool.reshape(-1), host.reshape(-1), layer, size)
    return Pieces(*_split(*merged, *host_pieces), layers)


def _merge(pool: np.ndarray, host: np.ndarray, layer: np.ndarray, size: int):
    """Runs of entries of one layer adjacent on both sides, as one entry each."""
    if pool.size == 0:
        return pool, host, np.zeros(0, np.uint64), layer
    step = np.uint64(size)
    joined = ((pool[1:] == pool[:-1] + step) & (host[1:] == host[:-1] + step)
              & (layer[1:] == layer[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    lengths = np.diff(np.append(starts, pool.size)).astype(np.uint64)
    return pool[starts], host[starts], lengths * step, layer[starts]


def _split(pool: np.ndarray, host: np.ndarray, size: np.ndarray, layer: np.ndarray, base: int,
           piece: int):
    """Entries cut where the host side crosses from one registered piece to the next."""
    first = (host - np.uint64(base)) // np.uint64(piece)
    last = (host + size - np.uint64(1) - np.uint64(base)) // np.uint64(piece)
    crossing = np.flatnonzero(first != last)
    if crossing.size == 0:
        return pool, host, size, layer
    out: list[list] = [[], [], [], []]
    prev = 0
    for i in crossing:
        for k, arr in enumerate((pool, host, size, layer)):
            out[k].append(arr[prev:i])
        at, end = int(host[i]), int(host[i] + size[i])
        while at < end:
            cut = min(end, base + ((at - base) // piece + 1) * piece)
            for k, v in enumerate((int(pool[i]) + at - int(host[i]), at, cut - at)):
                out[k].append(np.array([v], np.uint64))
            out[3].append(layer[i:i + 1])
            at = cut
        prev = i + 1
    for k, arr in enumerate((pool, host, size, layer)):
        out[k].append(arr[prev:])
    return tuple(np.concatenate(parts) for parts in out)


class DmaQueue:
    """One direction of one GPU: batches of copies spread over ``n`` streams."""

    def __init__(self, cp: Any, n_streams: int) -> None:
        self.cp, self.rt = cp, cp.cuda.runtime
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(max(1, n_streams))]
        self._joins = [self.rt.eventCreateWithFlags(_EVENT_NO_TIMING) for _ in self.streams[1:]]
        self.queued: list = []  # (event, bytes, arrays) of batches not known to be done

    @property
    def stream(self) -> Any:
        """The stream that every batch joins into."""
        return self.streams[0]

    def queued_bytes(self) -> int:
        self.queued = [q for q in self.queued if not q[0].done]
        return sum(q[1] for q in self.queued)

    def enqueue(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> Any:
        """Queue copies ``src[i] -> dst[i]`` of ``size[i]`` bytes; returns the event
        recorded on ``stream`` after all of them."""
        if size.size:
            cuts = np.searchsorted(np.cumsum(size), np.linspace(0, int(size.sum()),
                                                                len(self.streams) + 1)[1:-1])
            bounds = [0, *cuts.tolist(), size.size]
            for k, s in enumerate(self.streams):
                a, b = bounds[k], bounds[k + 1]
                if b <= a:
                    continue
                cuda_driver.memcpy_batch_async(s.ptr, dst[a:b], src[a:b], size[a:b])
                if k:
                    self.rt.eventRecord(self._joins[k - 1], s.ptr)
                    self.rt.streamWaitEvent(self.stream.ptr, self._joins[k - 1], 0)
        done = self.cp.cuda.Event(block=False, disable_timing=True)
        done.record(self.stream)
        self.queued.append((done, int(size.sum()), (dst, src, size)))  # the driver's arrays
        return done

    def close(self) -> None:
        """Free the events; the caller synchronized the streams."""
        for ev in self._joins:
            self.rt.eventDestroy(ev)
        self.queued = []


def _steps(layer_bytes: np.ndarray, most: int) -> list[int]:
    """Ends of consecutive layer groups of at most ``most`` bytes (at least one layer each)."""
    ends, acc = [], 0
    for layer, n in enumerate(layer_bytes.tolist()):
        if acc and acc + n > most:
            ends.append(layer)
            acc = 0
        acc += n
    ends.append(len(layer_bytes))
    return ends


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
        p = pieces(layout, bases, page_ids, ptrs, chunk_tokens, self.host_pieces)
        self.store_queue.enqueue(p.host, p.pool, p.size)
        return self.store_queue.stream

    async def load(self, layout: Any, bases: np.ndarray, page_ids: np.ndarray, ptrs: np.ndarray,
                   chunk_tokens: int, signal: Any) -> Any:
        """Queue a load (arena -> pool) in steps of whole layers of about ``window / 4``
        bytes, each after the host found the load not cancelled and at most ``window``
        bytes queued; a layer-wise ``signal`` gets each layer's word behind that layer.
        Returns the stream it ends on (the caller writes the done word there, also
        after a cancel or an error)."""
        q, p = self.load_queue, pieces(layout, bases, page_ids, ptrs, chunk_tokens, self.host_pieces)
        ends = _steps(p.layer_bytes, max(1, self.window // 4))
        a = 0
        for b in ends:
            while q.queued_bytes() > self.window:
                await self.poller.wait(q.queued[0][0])
            if signal is not None and signal.source.cancelled:
                break  # what is queued runs; nothing more touches the pages
            with self.cp.cuda.Device(self.ordinal):  # not held across the await above
                if signal is not None and signal.layerwise:
                    for layer in range(a, b):
                        q.enqueue(*p.span(layer, layer + 1))
                        signal.layers_landed(q.stream, (layer,))
                else:
                    q.enqueue(*p.span(a, b))
            a = b
        return q.stream

    def close(self) -> None:
        self.store_queue.close()
        self.load_queue.close()
