"""Why kvd's copies slow an engine's GEMM, and what a copy-engine-only path gives.

A measurement probe, not part of kvd. On a machine with a CUDA GPU:

    python3 tools/probes/interference_probe.py [--quick]

Part 1, batched DMA rate: ``cuMemcpyBatchAsync_v2`` over the (layer, plane,
page) pieces of a paged pool (Llama-3-8B: 32 layers, 8 heads x 128, bf16;
DeepSeek-MLA: 61 layers x 1152-byte rows), split over 1, 2 or 4 streams,
against one pinned cudaMemcpy of the same bytes. Round trips are checked
byte for byte on random data.

Part 2, interference: an engine process runs samples of 10 bf16 8192^3
GEMMs timed with CUDA events while a second process (its own CUDA context,
as the daemon is) does one thing continuously: nothing; an empty kernel R
times a second; batched DMA; or a staged gather (kernel into a device slot,
then one DMA); ``d2d1d:N`` the batched copies into a device buffer instead
of the host (does a copy-engine device-to-device copy time-slice?),
``staged1d:N`` those then one DMA of the buffer to the host, ``d2dbig`` one
contiguous device-to-device memcpy. The engine's slowdown (mean and median of the samples) and
the copier's rate show whether the cost is per kernel launch of the other
context (time-slice switches) or per byte. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import statistics
import time

SHAPES = {"llama": (32, 2, 8 * 128 * 2), "mla": (61, 1, 1152)}  # layers, planes, row bytes


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Loc), ("dstLocHint", _Loc),
                ("flags", ctypes.c_uint)]


def _batch_fn():
    f = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync_v2
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_size_t, ctypes.c_void_p]
    return f


class Batch:
    """Pieces (dst, src, size) split over streams; ``run()`` enqueues them all."""

    def __init__(self, dst, src, size, streams, flags=0):
        import numpy as np
        self.f, self.streams = _batch_fn(), streams
        self.attr = _Attr(1, _Loc(0, 0), _Loc(0, 0), flags)  # stream order
        self.attr_at = ctypes.c_size_t(0)  # the one attribute applies from piece 0 on
        parts = np.array_split(np.arange(len(dst)), len(streams))
        self.parts = [(np.ascontiguousarray(dst[p]), np.ascontiguousarray(src[p]),
                       np.ascontiguousarray(size[p])) for p in parts]

    def run(self):
        for (d, s, z), st in zip(self.parts, self.streams):
            rc = self.f(d.ctypes.data, s.ctypes.data, z.ctypes.data, len(d), ctypes.byref(self.attr),
                        ctypes.byref(self.attr_at), 1, st.cuda_stream)
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync_v2 -> {rc}")


def make_pool(shape, page_tokens, pages, tokens, seed):
    """A pool [layer][plane][page] of page_tokens rows, and page ids for ``tokens`` tokens."""
    import numpy as np
    import torch
    layers, planes, row = shape
    pool = torch.empty(layers, planes, pages, page_tokens * row, dtype=torch.uint8, device="cuda")
    ids = np.random.default_rng(seed).choice(pages, tokens // page_tokens, replace=False)
    return pool, ids


def pieces(pool, ids, host_ptr, to_host):
    import numpy as np
    layers, planes, pages, piece = pool.shape
    lp = np.arange(layers * planes, dtype=np.uint64)[:, None]
    dev = (pool.data_ptr() + lp * np.uint64(pages * piece) + ids.astype(np.uint64)[None, :]
           * np.uint64(piece)).reshape(-1)
    host = host_ptr + np.arange(dev.size, dtype=np.uint64) * np.uint64(piece)
    size = np.full(dev.size, piece, dtype=np.uint64)
    return (host, dev, size) if to_host else (dev, host, size)


def timeit(fn, reps):
    import torch
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def dma_rates(reps, stream_counts, flags, cases):
    import torch
    for case in cases:
        name, page_tokens = case.split(":")
        page_tokens = int(page_tokens)
        tokens = 2048 if page_tokens > 1 else 512
        shape = SHAPES[name]
        pool, ids = make_pool(shape, page_tokens, 4096 if page_tokens < 64 else 1024, tokens, 0)
        pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, device="cuda"))
        nbytes = shape[0] * shape[1] * tokens * shape[2]
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        base = {"d2h": timeit(lambda: host.copy_(dev, non_blocking=True), reps),
                "h2d": timeit(lambda: dev.copy_(host, non_blocking=True), reps)}
        row = {"shape": name, "page": page_tokens, "piece_bytes": page_tokens * shape[2],
               "MB": round(nbytes / 1e6), "memcpy_GBps": {k: round(nbytes / v / 1e9, 1)
                                                           for k, v in base.items()}}
        for n in stream_counts:
            streams = [torch.cuda.Stream() for _ in range(n)]
            out = Batch(*pieces(pool, ids, host.data_ptr(), True), streams, flags)
            back = Batch(*pieces(pool, ids, host.data_ptr(), False), streams, flags)
            row[f"d2h_{n}s"] = round(base["d2h"] / timeit(out.run, reps), 3)
            row[f"h2d_{n}s"] = round(base["h2d"] / timeit(back.run, reps), 3)
        host.fill_(0)
        out.run()
        torch.cuda.synchronize()
        ref = pool[:, :, torch.as_tensor(ids, device="cuda")].reshape(-1).cpu()
        pool.fill_(7)
        back.run()
        torch.cuda.synchronize()
        row["exact"] = bool(torch.equal(ref, host)) and bool(
            torch.equal(pool[:, :, torch.as_tensor(ids, device="cuda")].reshape(-1).cpu(), ref))
        print(json.dumps(row), flush=True)
        pool = host = dev = out = back = None  # freed before the next case
        torch.cuda.empty_cache()


_BATCHED = ("dma", "d2d1d", "staged1d")  # modes whose arg is a stream count


def copier(mode, arg, flags, stop, ready, result):
    import torch
    shape = SHAPES["llama"]
    pool, ids = make_pool(shape, 16, 4096, 2048, 1)
    nbytes = shape[0] * shape[1] * 2048 * shape[2]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    tid = torch.as_tensor(ids, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(max(1, int(arg) if mode in _BATCHED else 1))]
    stage = torch.empty(nbytes, dtype=torch.uint8, device="cuda") if mode != "dma" else None
    batch = (Batch(*pieces(pool, ids, (host if mode == "dma" else stage).data_ptr(), True),
                   streams, flags) if mode in _BATCHED else None)
    tiny = torch.zeros(1, device="cuda")
    ready.set()
    moved, t0 = 0, time.perf_counter()
    while not stop.is_set():
        if mode == "empty":
            for _ in range(int(arg) // 100):
                tiny.add_(1)
                time.sleep(0.01 / (int(arg) // 100))
            torch.cuda.synchronize()
        elif mode == "dma":
            batch.run()
            torch.cuda.synchronize()
            moved += nbytes
        elif mode in ("d2d1d", "staged1d"):  # copy-engine gather into a device buffer
            batch.run()
            if mode == "staged1d":  # then one contiguous DMA of it to the host
                for st in streams[1:]:
                    streams[0].wait_stream(st)
                with torch.cuda.stream(streams[0]):
                    host.copy_(stage, non_blocking=True)
            torch.cuda.synchronize()
            moved += nbytes
        elif mode == "d2dbig":  # one contiguous device-to-device memcpy
            stage.copy_(pool.view(-1)[:nbytes])
            torch.cuda.synchronize()
            moved += nbytes
        elif mode == "gather":  # layers per kernel = arg; a slot of 32 MiB per kernel at most
            per = int(arg)
            with torch.cuda.stream(streams[0]):
                for a in range(0, shape[0], per):
                    g = pool[a:a + per].index_select(2, tid).reshape(-1)
                    host[a * g.numel() // per:(a + per) * g.numel() // per].copy_(g, non_blocking=True)
            streams[0].synchronize()
            moved += nbytes
        else:
            time.sleep(0.01)
    result.put({"copier_GBps": round(moved / (time.perf_counter() - t0) / 1e9, 1)})


def engine_samples(samples):
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    out = []
    for _ in range(samples):
        ev[0].record()
        for _ in range(10):
            a @ b
        ev[1].record()
        torch.cuda.synchronize()
        out.append(ev[0].elapsed_time(ev[1]) / 10)
    return out


def interference(samples, modes, flags):
    ctx = mp.get_context("spawn")
    alone = engine_samples(samples)
    base_mean = statistics.mean(alone)
    print(json.dumps({"gemm_alone_ms": round(base_mean, 3),
                      "median": round(statistics.median(alone), 3)}), flush=True)
    for mode, arg in (m.split(":") for m in modes):
        stop, ready, result = ctx.Event(), ctx.Event(), ctx.Queue()
        p = ctx.Process(target=copier, args=(mode, int(arg), flags, stop, ready, result))
        p.start()
        ready.wait(120)
        time.sleep(0.5)
        during = engine_samples(samples)
        stop.set()
        row = result.get(timeout=60)
        p.join(30)
        mean = statistics.mean(during)
        print(json.dumps({"copier": mode, "arg": arg, "gemm_ms": round(mean, 3),
                          "slowdown_pct": round(100 * (mean / base_mean - 1), 1),
                          "median_slowdown_pct": round(
                              100 * (statistics.median(during) / statistics.median(alone) - 1), 1),
                          **row}), flush=True)
    again = statistics.mean(engine_samples(samples))
    print(json.dumps({"gemm_alone_again_ms": round(again, 3)}), flush=True)


def main():
    import torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--part", choices=("all", "dma", "interference"), default="all")
    ap.add_argument("--streams", default="1,2,4", help="stream counts for the DMA rates")
    ap.add_argument("--flags", type=int, default=0, help="cuMemcpyBatchAsync attribute flags "
                    "(1: CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)")
    ap.add_argument("--cases", default="llama:16,llama:64,llama:1,mla:16,mla:64",
                    help="shape:page_tokens for the DMA rates")
    ap.add_argument("--modes", default="idle:0,empty:500,empty:2000,empty:8000,dma:1,dma:2,dma:4,"
                    "gather:32,gather:4,gather:1,idle:0", help="copier mode:arg for the interference")
    args = ap.parse_args()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    if args.part in ("all", "dma"):
        dma_rates(3 if args.quick else 7, [int(n) for n in args.streams.split(",")], args.flags,
                  args.cases.split(","))
    if args.part in ("all", "interference"):
        interference(10 if args.quick else 30, args.modes.split(","), args.flags)


if __name__ == "__main__":
    main()
