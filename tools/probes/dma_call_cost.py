#!/usr/bin/env python3
"""Host time of queuing single-row DMA copies, by streams and rows per copy (GPU machine).

    PYTHONPATH=$PWD/clients:$PWD python3 tools/probes/dma_call_cost.py [--rows 16,128,1024]
        [--streams 1,2,8] [--row-bytes 1179648] [--repeat 21]

What the daemon's event loop pays to queue one copy of N single rows
(``kvd.cuda.dma.queue.DmaQueue.enqueue``: the rows split over S streams, one
``cuMemcpyBatchAsync`` per stream, events joining the streams), next to N
plain ``cudaMemcpyAsync`` calls on one stream. Rows go from a pinned host
buffer to device memory at random row slots. Per (N, S): the median host
microseconds of the enqueue (the copies are synchronized before each one
and not timed), and per row; then the PCIe time of the same bytes, so the
share of the copy's time the loop spends queuing it is plain. A probe, not
a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="16,128,1024", help="rows per copy, comma-separated")
    p.add_argument("--streams", default="1,2,8", help="streams per copy, comma-separated")
    p.add_argument("--row-bytes", type=int, default=1179648, help="bytes per row (default: a "
                   "16-token page of the DeepSeek-MLA shape)")
    p.add_argument("--repeat", type=int, default=21, help="timed copies per figure (median)")
    args = p.parse_args()
    import cupy as cp

    from kvd.cuda.dma.queue import DmaQueue
    from kvd.cuda.dma.plan import OP_DTYPE, Step

    counts = [int(v) for v in args.rows.split(",")]
    most, size = max(counts), args.row_bytes
    host = cp.cuda.alloc_pinned_memory(most * size)
    dev = cp.cuda.alloc(2 * most * size)
    rng = np.random.default_rng(0)
    print(f"{'rows':>6}{'way':>14}{'host us':>10}{'us/row':>8}{'PCIe us':>9}{'share':>7}")
    for n in counts:
        slots = rng.permutation(2 * most)[:n].astype(np.uint64)
        dst = np.uint64(dev.ptr) + slots * np.uint64(size)
        src = np.uint64(host.ptr) + np.arange(n, dtype=np.uint64) * np.uint64(size)
        sizes = np.full(n, size, np.uint64)
        pcie = _pcie_us(cp, dev.ptr, src, sizes)
        for s in (int(v) for v in args.streams.split(",")):
            q = DmaQueue(cp, s)
            step = Step(np.zeros(0, OP_DTYPE), dst, src, sizes)
            us = _timed(cp, lambda q=q, step=step: q.enqueue(step), args.repeat)
            _row(n, f"batch x{s}", us, pcie)
            q.close()
        stream = cp.cuda.Stream(non_blocking=True)
        us = _timed(cp, lambda: [cp.cuda.runtime.memcpyAsync(int(d), int(h), size, 1, stream.ptr)
                                 for d, h in zip(dst, src)], args.repeat)
        _row(n, "memcpyAsync", us, pcie)
    return 0


def _timed(cp, queue, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        queue()
        times.append((time.perf_counter() - t0) * 1e6)
    cp.cuda.Device().synchronize()
    return statistics.median(times[1:])


def _pcie_us(cp, dev_ptr: int, src, sizes) -> float:
    """The same bytes as one pinned cudaMemcpy, in microseconds."""
    stream = cp.cuda.Stream(non_blocking=True)
    total = int(sizes.sum())
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(5):
        start.record(stream)
        cp.cuda.runtime.memcpyAsync(dev_ptr, int(src.min()), total, 1, stream.ptr)
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return statistics.median(times)


def _row(n: int, way: str, us: float, pcie: float) -> None:
    print(f"{n:>6}{way:>14}{us:>10.0f}{us / n:>8.2f}{pcie:>9.0f}{us / pcie:>7.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
