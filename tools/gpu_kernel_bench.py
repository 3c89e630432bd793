#!/usr/bin/env python3
"""Throughput of kvd's gather/scatter kernels next to one pinned cudaMemcpy.

Pools: Llama-3-8B shape (32 layers, 8 KV heads, head dim 128, bf16, vLLM
flash-attn layout) at page sizes 1/16/64/256, the same shape as vLLM's GPU
blocks (K and V side by side in each head: rows of 8 head-strided pieces),
heads outer ("hnc") and tokens outer ("nhc"), at page sizes 16/64, and
DeepSeek MLA (576-wide bf16 latent, vLLM MLA layout) at page sizes 1/16/64;
256-token chunks, random pages. Each kernel figure is the median of several runs timed with
CUDA events, measured interleaved with one cudaMemcpyAsync of the same byte
count between device memory and pinned host memory (device -> host for
gather, host -> device for scatter). Modes: "zero-copy" is one call for all
chunks, the kernel reading or writing pinned host memory directly;
"staged" copies through a device staging buffer (kernel + one DMA);
"1chunk-calls" is one call per chunk; "per-layer" one call per layer (all
chunks), as layer-wise loads would. Prints a table last; --out writes every
figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import cupy as cp
import numpy as np

from kvd.cuda.kernels import KernelCopier, desc_params, plane_bases
from kvd_protocol import layout as L

CHUNK = 256
D2H, H2D = 2, 1


def contiguous(shape, itemsize, offset):
    strides, acc = [], itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return L.TensorRef(0, offset, tuple(shape), tuple(reversed(strides)), itemsize), acc


def make_pool(kind, layers, page_size, tokens):
    """Tensors packed back to back (offsets stay multiples of the row piece size)."""
    off, refs = 0, []
    pages = tokens // page_size
    shape = {"llama": (2, pages, page_size, 8, 128), "mla": (pages, page_size, 576),
             "hnc": (pages, 8, page_size, 256), "nhc": (pages, page_size, 8, 256)}[kind]
    for _ in range(layers):
        ref, nbytes = contiguous(shape, 2, off)
        if kind == "nhc":  # logical [blocks, heads, block_size, 2 * head_size]
            swap = (0, 2, 1, 3)
            ref = L.TensorRef(0, off, tuple(ref.shape[i] for i in swap),
                              tuple(ref.strides[i] for i in swap), 2)
        refs.append(ref)
        off += nbytes
    if kind in ("hnc", "nhc"):
        return L.vllm_kv_blocks(refs, 128), off
    return (L.vllm_flash_attn(refs) if kind == "llama" else L.vllm_mla(refs)), off


class Bench:
    def __init__(self, reps):
        self.reps = reps
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.copiers = {}
        self.rows = []
        self.host_us = []

    def copier(self, cap, threads, unroll=4):
        key = (cap, threads, unroll)
        if key not in self.copiers:
            opts = () if unroll == 4 else (f"-DKV_UNROLL={unroll}",)
            self.copiers[key] = KernelCopier(0, max_blocks=cap, threads=threads,
                                             compile_options=opts)
        return self.copiers[key]

    def time_ms(self, fn):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record(self.stream)
        fn()
        e.record(self.stream)
        e.synchronize()
        return cp.cuda.get_elapsed_time(s, e)

    def pair(self, fn, base):
        """Interleaved medians (ms) of fn and of the baseline copy."""
        for _ in range(2):
            fn()
            base()
        self.stream.synchronize()
        a, b = [], []
        for _ in range(self.reps):
            b.append(self.time_ms(base))
            a.append(self.time_ms(fn))
        return statistics.median(a), statistics.median(b), min(a), max(a)


def run_pool(bench, kind, layers, page_size, n_chunks, caps, extra):
    ppc = CHUNK // page_size
    tokens = max(4 * n_chunks * CHUNK, 2 * page_size)
    desc, size = make_pool(kind, layers, page_size, tokens)
    shard = desc.shard_bytes(CHUNK)
    nbytes = n_chunks * shard
    pool = cp.random.random(size // 4, dtype=cp.float32).view(cp.uint8)
    staging = cp.empty(nbytes, cp.uint8)
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    host = np.frombuffer(mem, np.uint8, nbytes)
    host[:] = 0x5A
    cp.cuda.runtime.deviceSynchronize()
    rng = np.random.default_rng(page_size)
    pages = rng.choice(desc.num_pages, n_chunks * ppc, replace=False)
    bases = plane_bases(desc, [pool.data.ptr])
    params = dict(desc_params(desc), chunk_tokens=CHUNK, stream=bench.stream)
    hptrs = [host.ctypes.data + k * shard for k in range(n_chunks)]
    dptrs = [staging.data.ptr + k * shard for k in range(n_chunks)]
    st = bench.stream.ptr

    # spot check of one gather (chunk 0 and the last) against cupy fancy indexing, piece by
    # piece (a piece is a whole row where rows are not head-strided)
    bench.copier(32, 512).gather(bases, pages, hptrs, **params)
    bench.stream.synchronize()
    piece = desc.piece_bytes
    pieces = pool.reshape(-1, piece)
    for c in (0, n_chunks - 1):
        t = np.arange(CHUNK)
        pg = pages[c * ppc:(c + 1) * ppc][t // page_size]
        base = np.array([o for _, o in desc.bases]).reshape(-1, 1, 1)
        off = (base + (pg * desc.page_stride + (t % page_size) * desc.token_stride)[:, None]
               + np.arange(desc.heads) * desc.head_stride)        # (layer-plane, token, head)
        assert not (off % piece).any(), "pieces must be aligned to their size for this check"
        want = pieces[cp.asarray((off // piece).reshape(-1))].reshape(-1)
        if not bool((want == cp.asarray(host[c * shard:(c + 1) * shard])).all()):
            raise SystemExit(f"gather spot check failed: {kind} page size {page_size} chunk {c}")

    def d2h():
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, staging.data.ptr, nbytes, D2H, st)

    def h2d():
        cp.cuda.runtime.memcpyAsync(staging.data.ptr, host.ctypes.data, nbytes, H2D, st)

    configs = [(cap, 512, 4, "zero-copy") for cap in caps] + list(extra)
    for cap, threads, unroll, mode in configs:
        cop = bench.copier(cap, threads, unroll)
        for direction in ("gather", "scatter"):
            if mode == "staged" and direction == "gather":
                def fn(cop=cop):
                    cop.gather(bases, pages, dptrs, **params)
                    d2h()
            elif mode == "staged":
                def fn(cop=cop):
                    h2d()
                    cop.scatter(bases, pages, dptrs, **params)
            elif mode == "1chunk-calls":
                def fn(cop=cop, direction=direction):
                    call = getattr(cop, direction)
                    for k in range(n_chunks):
                        call(bases, pages[k * ppc:(k + 1) * ppc], hptrs[k:k + 1], **params)
            elif mode == "per-layer":
                def fn(cop=cop, direction=direction):
                    call = getattr(cop, direction)
                    for layer in range(layers):
                        call(bases, pages, hptrs, layer_begin=layer, layer_end=layer + 1, **params)
            else:
                def fn(cop=cop, direction=direction):
                    getattr(cop, direction)(bases, pages, hptrs, **params)
            med, base, lo, hi = bench.pair(fn, d2h if direction == "gather" else h2d)
            row = {"pool": kind, "layers": layers, "page": page_size, "dir": direction,
                   "mode": mode, "cap": cap, "threads": threads, "unroll": unroll,
                   "MB": nbytes / 1e6, "chunks": n_chunks, "kernel_ms": med,
                   "kernel_min_ms": lo, "kernel_max_ms": hi, "memcpy_ms": base,
                   "kernel_GBps": nbytes / med / 1e6, "memcpy_GBps": nbytes / base / 1e6,
                   "ratio": base / med, "vec": cop.last_plan.get("vec_bytes")}
            bench.rows.append(row)
            print(json.dumps(row), flush=True)
    # host cost of one call (1 chunk), the request-path overhead
    cop = bench.copier(32, 512)
    host_us = []
    for _ in range(50):
        t0 = time.perf_counter()
        cop.gather(bases, pages[:ppc], hptrs[:1], **params)
        host_us.append((time.perf_counter() - t0) * 1e6)
        bench.stream.synchronize()
    line = (f"{kind} page {page_size}: host time of one 1-chunk gather call "
            f"{statistics.median(host_us):.1f} us (median of 50)")
    bench.host_us.append(line)
    print(line, flush=True)
    del pool, staging, host, mem


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--mla-layers", type=int, default=61)
    ap.add_argument("--caps", default="2,4,8,16,32,132")
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    caps = [int(c) for c in args.caps.split(",")]
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"GPU {name}, {props['multiProcessorCount']} SMs, cupy {cp.__version__}", flush=True)
    bench = Bench(args.reps)
    common = [(16, 512, 4, "staged"), (16, 512, 4, "1chunk-calls"), (16, 512, 4, "per-layer")]
    variants = [(2, 1024, 4, "zero-copy"), (4, 1024, 4, "zero-copy"), (16, 256, 4, "zero-copy"),
                (16, 1024, 4, "zero-copy"), (16, 512, 8, "zero-copy")]
    for ps in (1, 16, 64, 256):
        extra = common + (variants if ps == 16 and not args.quick else [])
        run_pool(bench, "llama", 32, ps, args.chunks, caps, extra)
    run_pool(bench, "llama", 32, 16, 1, [16], [])
    for kind in ("hnc", "nhc"):
        for ps in (16, 64):
            run_pool(bench, kind, 32, ps, args.chunks, caps, common)
    for ps in (1, 16, 64):
        run_pool(bench, "mla", args.mla_layers, ps, args.chunks, caps, common)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": name, "rows": bench.rows}, f, indent=1)
    print()
    for line in bench.host_us:
        print(line)
    print(f"GPU {name}; GB/s = 10^9 B/s; memcpy = one cudaMemcpyAsync of the same bytes, "
          f"pinned host, same run; ratio = memcpy time / kernel time; median of {args.reps}")
    print(f"{'pool':5} {'page':>4} {'dir':7} {'mode':12} {'cap':>4} {'thr':>4} {'unr':>3} "
          f"{'MB':>6} {'vec':>3} {'kernel':>7} {'memcpy':>7} {'ratio':>6}")
    for r in bench.rows:
        print(f"{r['pool']:5} {r['page']:>4} {r['dir']:7} {r['mode']:12} {r['cap']:>4} "
              f"{r['threads']:>4} {r['unroll']:>3} {r['MB']:>6.0f} {r['vec']!s:>3} "
              f"{r['kernel_GBps']:>7.1f} {r['memcpy_GBps']:>7.1f} {r['ratio']:>6.3f}")


if __name__ == "__main__":
    main()
