#!/usr/bin/env python3
"""How long an engine's stream mark takes to be seen while another process copies (GPU machine).

    PYTHONPATH=$PWD/clients:$PWD python3 tools/probes/mark_latency.py [--modes none,dma,dma-signal,kernel]
        [--marks 300] [--row-bytes 1179648] [--rows 128] [--streams 2]

The client marks the engine's stream (``cuStreamWriteValue32`` into a
host-mapped word) and the daemon copies once it sees the mark. This probe
times that round trip on an idle stream of this process (queue the write,
spin on the host word) while a second process (the copier, another CUDA
context, as the daemon is) keeps the GPU busy:

- ``none``: no copier (the floor);
- ``dma``: pinned ``cudaMemcpyAsync`` of ``--rows`` rows of ``--row-bytes``
  both ways on ``--streams`` streams per direction, two batches in flight;
- ``dma-signal``: the same, plus a ``cuStreamWriteValue32`` into a host
  word after each batch on each stream (what a load's layer and done words
  are);
- ``kernel``: the same DMA plus a one-block kernel after each batch on each
  stream.

Prints the median, 90th percentile and maximum in microseconds per mode. A
probe, not a test.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

MODES = ("none", "dma", "dma-signal", "kernel")
_KERNEL = 'extern "C" __global__ void touch(unsigned *w) { if (threadIdx.x == 0) w[0] += 1; }'


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--marks", type=int, default=300, help="marks timed per mode")
    p.add_argument("--interval-ms", type=float, default=1.0, help="pause between marks")
    p.add_argument("--row-bytes", type=int, default=1179648,
                   help="bytes per copied row (default: a 16-token DeepSeek-MLA page)")
    p.add_argument("--rows", type=int, default=128, help="rows per batch")
    p.add_argument("--streams", type=int, default=2, help="copier streams per direction")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes: {', '.join(sorted(unknown))}")
    print(f"{'mode':>12}{'median us':>11}{'p90 us':>9}{'max us':>9}{'copier GB/s':>13}")
    ctx = mp.get_context("spawn")
    for mode in modes:
        lat, rate = _one_mode(ctx, mode, args)
        lat.sort()
        print(f"{mode:>12}{statistics.median(lat):>11.0f}{lat[int(0.9 * len(lat))]:>9.0f}"
              f"{lat[-1]:>9.0f}{rate:>13.1f}")
    return 0


def _one_mode(ctx, mode: str, args) -> tuple[list, float]:
    stop, ready, rate = ctx.Event(), ctx.Event(), ctx.Value("d", float("nan"))
    copier = None
    if mode != "none":
        copier = ctx.Process(target=_copy, args=(mode, args, stop, ready, rate))
        copier.start()
        if not ready.wait(120):
            copier.kill()
            raise SystemExit("the copier did not start")
    try:
        lat = _marks(args)
    finally:
        stop.set()
        if copier is not None:
            copier.join(60)
            if copier.is_alive():
                copier.kill()
    return lat, rate.value


def _marks(args) -> list:
    """Microseconds from queuing each mark on an idle stream until the host sees it."""
    import cupy as cp

    from kvd_protocol import cuda_driver
    cp.cuda.Device(0).use()
    cp.cuda.runtime.free(cp.cuda.runtime.malloc(1))  # the primary context is current
    buf = np.frombuffer(_page_aligned(4096), "<u4")  # host registration wants whole pages
    dev = cuda_driver.register_host(buf.ctypes.data, 4096, 0)
    stream = cp.cuda.Stream(non_blocking=True)
    out = []
    try:
        for i in range(1, args.marks + 1):
            t0 = time.perf_counter()
            cuda_driver.stream_write_u32(stream.ptr, dev, i)
            while int(buf[0]) != i:
                pass
            out.append((time.perf_counter() - t0) * 1e6)
            time.sleep(args.interval_ms / 1e3)
        stream.synchronize()
    finally:
        cuda_driver.unregister_host(buf.ctypes.data)
    return out


def _page_aligned(size: int) -> memoryview:
    import mmap
    return memoryview(mmap.mmap(-1, size))


def _copy(mode: str, args, stop, ready, rate) -> None:
    """The copier: rows both ways, two batches in flight per stream, until ``stop``."""
    import cupy as cp

    from kvd_protocol import cuda_driver
    cp.cuda.Device(0).use()
    size, rows = args.row_bytes, args.rows
    host = cp.cuda.alloc_pinned_memory(2 * rows * size)
    dev = cp.cuda.alloc(2 * rows * size)
    flag = np.frombuffer(_page_aligned(4096), "<u4")
    flag_dev = cuda_driver.register_host(flag.ctypes.data, 4096, 0)
    touch = cp.RawKernel(_KERNEL, "touch")
    word = cp.zeros(1, cp.uint32)
    streams = [(cp.cuda.Stream(non_blocking=True), way) for way in (1, 2)
               for _ in range(args.streams)]
    per = max(1, rows // args.streams)
    inflight, moved, seq = [], 0, 0
    ready.set()
    t0 = time.perf_counter()
    while not stop.is_set():
        seq += 1
        events = []
        for k, (s, way) in enumerate(streams):
            base = (k % args.streams) * per
            for r in range(base, min(rows, base + per)):
                h, d = host.ptr + (r + (way - 1) * rows) * size, dev.ptr + (r + (way - 1) * rows) * size
                dst, src = (d, h) if way == 1 else (h, d)
                cp.cuda.runtime.memcpyAsync(dst, src, size, way, s.ptr)
                moved += size
            if mode == "dma-signal":
                cuda_driver.stream_write_u32(s.ptr, flag_dev, seq)
            elif mode == "kernel":
                touch((1,), (32,), (word,), stream=s)
            e = cp.cuda.Event(block=False, disable_timing=True)
            e.record(s)
            events.append(e)
        inflight.append(events)
        if len(inflight) > 2:
            for e in inflight.pop(0):
                e.synchronize()
    for events in inflight:
        for e in events:
            e.synchronize()
    rate.value = moved / (time.perf_counter() - t0) / 1e9
    cuda_driver.unregister_host(flag.ctypes.data)


if __name__ == "__main__":
    raise SystemExit(main())
