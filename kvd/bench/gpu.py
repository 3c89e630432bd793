"""``kvd bench --gpu``: end-to-end GPU offload and load through a private daemon.

This process is the engines: it allocates torch KV pools (``--gpu-pool``: one, per-layer,
vmm), exports them through CUDA IPC and times client calls to completion. By default
``--pipeline 4`` requests in flight (kvd.bench.pipeline) with scattered page ids;
``--blocking`` adds one request at a time against pinned ``cudaMemcpy`` of the same bytes
and a GEMM's slowdown meanwhile (``--interference``: an engine in its own process).
Medians of ``--repeat`` runs. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from . import pipeline
from .common import (
    on_stream,
    page_sets,
    request_bytes,
    start_daemon,
    stop_daemon,
    without_gpu_stack,
    write_json,
)

OWN_SEGMENT = 12 << 20  # bytes: PyTorch gives a tensor of 10 MiB or more a cudaMalloc of its own
POOLS = ("one", "per-layer", "block-outer", "vmm")  # make_pool's alloc
SHAPES = {  # name -> (layout, layers, kv_heads, head_dim)
    "llama3-8b": ("vllm_flash_attn", 32, 8, 128),
    "deepseek-mla": ("vllm_mla", 61, 1, 576),
    # vLLM's GPU blocks [blocks, heads, block, 2 x head]: as token rows (gpu_block_format
    # rows: head-strided, SM kernels) and kept whole (blocks: one range per block, DMA)
    "llama3-8b-vllm-rows": ("vllm_kv_blocks", 32, 8, 128),
    "llama3-8b-vllm-blocks": ("opaque", 32, 8, 256),
}
DEFAULT_SHAPES = ["llama3-8b", "deepseek-mla"]


def run(args) -> int:
    shapes = {name: SHAPES[name] for name in args.gpu_shapes}
    cap = host_capacity(args, shapes)
    if cap is None:
        return 2
    if without_gpu_stack("--gpu"):
        return 2
    import torch

    from kvd_client import KvdClient
    from kvd_client.torch_pool import CudaKVPool

    torch.cuda.init()
    rows, piped, gemm = [], [], None
    chunk = args.chunk_tokens
    blocking = args.blocking or not args.pipeline
    with tempfile.TemporaryDirectory(prefix="kvd-gbench-") as rundir:
        daemon = start_daemon(rundir, capacity=cap, chunk_tokens=chunk, extra=["--gpu", "on"],
                               log_path=args.daemon_log, profile=args.daemon_profile)
        try:
            for pool in args.gpu_pool:
                each = argparse.Namespace(**{**vars(args), "gpu_pool": pool})
                for name, shape in shapes.items():
                    for page in args.gpu_page_sizes:
                        if blocking:
                            rows.append({"pool": pool, **_measure_shape(
                                torch, KvdClient, CudaKVPool, rundir, name, shape, page, each)})
                        if args.pipeline:
                            piped.append({"pool": pool, **pipeline.measure(
                                torch, KvdClient, CudaKVPool, make_pool, rundir, name, shape, page,
                                each)})
            if blocking:
                gemm = _gemm_slowdown(torch, KvdClient, CudaKVPool, rundir,
                                      argparse.Namespace(**{**vars(args), "gpu_pool": args.gpu_pool[0]}))
        finally:
            stop_daemon(daemon, rundir, 60)
    pipeline.report(piped, args)
    if blocking:
        _report(torch, rows, gemm, args)
    if args.json:
        write_json(args.json, gpu=torch.cuda.get_device_name(), pools=args.gpu_pool,
                   page_order=args.page_order, repeat=args.repeat, chunk_tokens=chunk,
                   chunks=args.chunks, blocking=rows, pipelined=piped, gemm=gemm)
        print(f"json: {args.json}")
    if args.plot:
        _plot(torch, rows, piped, args)
    return 0


def host_capacity(args, shapes) -> int | None:
    """The private daemon's host tier: room for every request in flight of the largest
    shape, or ``--gpu-host-capacity`` when given and not smaller (else one line on stderr
    and None)."""
    req = max(request_bytes(s, args.chunks, args.chunk_tokens) for s in shapes.values())
    in_flight = max(2, args.clients) * (args.pipeline + 1) + 2 if args.pipeline else 3
    need = max(3, in_flight) * req + 2**24
    if args.gpu_host_capacity is None:
        return need
    if args.gpu_host_capacity < need:
        print(f"kvd bench: --gpu-host-capacity {args.gpu_host_capacity}: under the {need} bytes "
              "of the requests in flight", file=sys.stderr)
        return None
    return args.gpu_host_capacity


def _plot(torch, rows, piped, args) -> None:
    """Each path's GB/s as a ratio of the pinned cudaMemcpy measured in the same run: the
    pipelined figures when --pipeline ran (what engines that submit/poll get), else blocking."""
    from .plot import bars, command, machine
    if piped:
        series = {k: [r[f"{op}_ratio"] for r in piped]
                  for k, op in (("offload / d2h memcpy", "store"), ("load / h2d memcpy", "load"),
                                ("both / both memcpy", "both"))}
        what = f"{piped[0]['clients']} clients x {piped[0]['depth']} in flight"
    else:
        series = {"offload / d2h memcpy": [r["memcpy_d2h"] / r["store"] for r in rows],
                  "load / h2d memcpy": [r["memcpy_h2d"] / r["load"] for r in rows],
                  "both / both memcpy": [r["memcpy_both"] / r["both"] for r in rows]}
        what = "blocking requests"
    shown = piped or rows
    pools = len(args.gpu_pool) > 1
    bars(args.plot, f"kvd bench --gpu: CUDA path vs pinned cudaMemcpy ({what}), median of {args.repeat}",
         [(f"{r['pool']}\n" if pools else "") + f"{r['shape']}\npage {r['page']}" for r in shown], series,
         "ratio to memcpy",
         f"{machine(torch.cuda.get_device_name())}; {command()}", reference=1.0)
    print(f"plot: {args.plot}")


def make_pool(torch, CudaKVPool, shape, pages: int, page: int, alloc: str = "per-layer"):
    """A pool of random bf16 KV: each layer its own allocation (SGLang's, vLLM < 0.2x's),
    all layers in one (``alloc = "one"``: vLLM's single backing allocation), one with
    the blocks outermost (``"block-outer"``: a block's layers adjacent, as vLLM 0.32's
    ``BLHNC`` family lays them out), or CUDA virtual memory shared by file descriptor
    (``"vmm"``: vLLM 0.34's extensible KV cache, kvd.bench.vmm_pool)."""
    layout, layers, heads, dim = shape
    per_layer = {"vllm_mla": (pages, page, dim), "vllm_kv_blocks": (pages, heads, page, 2 * dim),
                 "opaque": (pages, heads, page, dim)}.get(layout, (2, pages, page, heads, dim))
    size = page if layout == "opaque" else None
    if alloc == "block-outer":
        axis = 2 if len(per_layer) == 5 else 1  # the block axis of (layers, *per_layer)
        inner = (layers, *per_layer[:axis - 1], *per_layer[axis:])
        whole = torch.randn(pages, *inner, dtype=torch.bfloat16, device="cuda").movedim(0, axis)
        return CudaKVPool(layout, list(whole.unbind(0)), size)
    if alloc == "one":
        whole = torch.randn(layers, *per_layer, dtype=torch.bfloat16, device="cuda")
        return CudaKVPool(layout, list(whole.unbind(0)), size)
    if alloc == "vmm":  # vLLM 0.34's extensible cache: a segment per layer, shared by fd
        from .vmm_pool import vmm_layers
        nbytes = int(np.prod(per_layer)) * 2
        views = [t.view(torch.bfloat16).view(per_layer).normal_()
                 for t in vmm_layers(torch, nbytes, layers)]
        return CudaKVPool(layout, views, size)
    torch.cuda.empty_cache()  # a cached free segment would be split between layers
    return CudaKVPool(layout, own_allocations(torch, per_layer, layers), size)


def own_allocations(torch, shape: tuple, n: int) -> list:
    """``n`` random bf16 tensors of ``shape``, each in a CUDA allocation of its own, as an
    engine's multi-GB layers are: PyTorch's caching allocator packs tensors under 10 MiB
    into shared 20 MiB segments, and the daemon would then copy several layers of a bench
    pool in one pitched op, which SGLang's pools never allow. So each tensor is the start
    of at least ``OWN_SEGMENT`` bytes; checked with the driver."""
    from kvd_protocol import cuda_driver
    numel = int(np.prod(shape))
    out = []
    for _ in range(n):
        flat = torch.empty(max(numel, OWN_SEGMENT // 2), dtype=torch.bfloat16, device="cuda")
        out.append(flat[:numel].view(shape).normal_())
    starts = {cuda_driver.pointer_attribute(t.data_ptr(), cuda_driver.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                            ctypes.c_uint64) for t in out}
    if len(starts) != n:
        raise RuntimeError(f"bench pool: {n} layers share {len(starts)} CUDA allocations; "
                           "each should have its own (is PYTORCH_CUDA_ALLOC_CONF set?)")
    return out


def memcpy_s(torch, nbytes: int, repeat: int) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    out = {"d2h": [], "h2d": [], "both": []}
    for i in range(repeat + 1):
        for key, fn in (("d2h", lambda: host[0].copy_(dev, non_blocking=True)),
                        ("h2d", lambda: dev.copy_(host[0], non_blocking=True))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i:
                out[key].append(time.perf_counter() - t0)
        dev2 = torch.empty_like(dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s1):
            host[1].copy_(dev2, non_blocking=True)
        with torch.cuda.stream(s2):
            dev.copy_(host[0], non_blocking=True)
        torch.cuda.synchronize()
        if i:
            out["both"].append(time.perf_counter() - t0)
        del dev2
    return {k: statistics.median(v) for k, v in out.items()}


def _measure_shape(torch, KvdClient, CudaKVPool, rundir, name, shape, page, args) -> dict:
    chunk, n = args.chunk_tokens, args.chunks
    ppc = chunk // page
    nbytes = request_bytes(shape, n, chunk)
    store_pool = make_pool(torch, CudaKVPool, shape, 2 * n * ppc, page, args.gpu_pool)
    load_pool = make_pool(torch, CudaKVPool, shape, 2 * n * ppc, page, args.gpu_pool)
    a = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True, heartbeat=False,
                  spin_s=args.spin_ms / 1e3).connect()
    b = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True, heartbeat=False,
                  spin_s=args.spin_ms / 1e3).connect()
    a.register_kv(store_pool, model=f"bench-{name}")
    b.register_kv(load_pool, model=f"bench-{name}")
    pages, other = page_sets(args.page_order, n * ppc, page)
    times = {"store": [], "load": [], "both": []}
    streams = (torch.cuda.Stream(), torch.cuda.Stream())  # two engines: a stream each
    base = 10**6 * page
    for i in range(args.repeat + 1):
        tokens = np.arange(n * chunk) + base + 2 * i * n * chunk
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stored = a.store(tokens, pages)
        t1 = time.perf_counter()
        loaded = b.load(tokens, pages)
        t2 = time.perf_counter()
        fresh = tokens + n * chunk  # store new chunks while loading the ones just stored
        worker = threading.Thread(target=on_stream, args=(torch, streams[0], a.store, fresh, other))
        t3 = time.perf_counter()
        worker.start()
        on_stream(torch, streams[1], b.load, tokens, other)
        worker.join()
        t4 = time.perf_counter()
        if stored != len(tokens) or loaded != len(tokens):
            raise RuntimeError(f"stored {stored}, loaded {loaded} of {len(tokens)} tokens")
        if i:
            times["store"].append(t1 - t0)
            times["load"].append(t2 - t1)
            times["both"].append(t4 - t3)
    a.close()
    b.close()
    del store_pool, load_pool
    torch.cuda.empty_cache()
    base_s = memcpy_s(torch, nbytes, args.repeat)
    return {"shape": name, "page": page, "bytes": nbytes,
            **{k: statistics.median(v) for k, v in times.items()},
            "memcpy_d2h": base_s["d2h"], "memcpy_h2d": base_s["h2d"], "memcpy_both": base_s["both"]}


def _gemm_slowdown(torch, KvdClient, CudaKVPool, rundir, args) -> dict:
    shape, page, chunk, n = SHAPES["llama3-8b"], 16, args.chunk_tokens, args.chunks
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def gemm_ms(iters=20):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            a @ b
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters

    gemm_ms(5)
    alone = statistics.median(gemm_ms() for _ in range(args.repeat))
    pool = make_pool(torch, CudaKVPool, shape, 2 * n * (chunk // page), page, args.gpu_pool)
    client = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True, heartbeat=False,
                       spin_s=args.spin_ms / 1e3).connect()
    client.register_kv(pool, model="bench-gemm")
    stop, window, stream = threading.Event(), threading.Event(), torch.cuda.Stream()
    moved = [0, 0.0]  # bytes stored + loaded while the GEMMs were timed, and that time

    def copy_loop():
        i = 0
        pages, other = page_sets(args.page_order, n * (chunk // page), 0)
        while not stop.is_set():
            tokens = np.arange(n * chunk) + 10**9 + i * n * chunk
            timed, t0 = window.is_set(), time.perf_counter()
            on_stream(torch, stream, client.store, tokens, pages)  # not behind the GEMMs
            on_stream(torch, stream, client.load, tokens, other)
            if timed and window.is_set():
                moved[0] += 2 * request_bytes(shape, n, chunk)
                moved[1] += time.perf_counter() - t0
            i += 1

    errors = []
    worker = threading.Thread(target=lambda: _catch(errors, copy_loop))
    worker.start()
    time.sleep(0.2)
    window.set()
    busy = statistics.median(gemm_ms() for _ in range(args.repeat))
    window.clear()
    stop.set()
    worker.join()
    client.close()
    if errors:
        raise errors[0]
    return {"alone_ms": alone, "with_copies_ms": busy, "slowdown": busy / alone - 1,
            "copy_GBps": moved[0] / moved[1] / 1e9 if moved[1] else 0.0}


def _catch(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
        errors.append(exc)


def _report(torch, rows, gemm, args) -> None:
    pools = list(dict.fromkeys(r.get("pool", args.gpu_pool) for r in rows)) or [args.gpu_pool]
    for pool in pools:
        print(f"\nblocking, one request at a time: GPU {torch.cuda.get_device_name()}; chunk "
              f"{args.chunk_tokens} tokens, {args.chunks} chunks per request, bf16, {pool} pools, "
              f"{args.page_order} page ids; median of {args.repeat}; GB/s = 1e9 B/s; ratio = memcpy "
              "time / kvd time")
        print(f"{'shape':<14}{'page':>5}{'MB':>7}{'offload':>9}{'ratio':>7}{'load':>8}{'ratio':>7}"
              f"{'both':>8}{'ratio':>7}   memcpy d2h/h2d/both GB/s")
        for r in rows:
            if r.get("pool", args.gpu_pool) != pool:
                continue
            gb = r["bytes"] / 1e9
            print(f"{r['shape']:<14}{r['page']:>5}{r['bytes'] / 1e6:>7.0f}"
                  f"{gb / r['store']:>9.1f}{r['memcpy_d2h'] / r['store']:>7.2f}"
                  f"{gb / r['load']:>8.1f}{r['memcpy_h2d'] / r['load']:>7.2f}"
                  f"{2 * gb / r['both']:>8.1f}{r['memcpy_both'] / r['both']:>7.2f}"
                  f"   {gb / r['memcpy_d2h']:.1f}/{gb / r['memcpy_h2d']:.1f}/{2 * gb / r['memcpy_both']:.1f}")
    print(f"\nbf16 GEMM 8192^3: {gemm['alone_ms']:.3f} ms alone, {gemm['with_copies_ms']:.3f} ms while "
          f"kvd copies (llama3-8b, page 16, {pools[0]} pool, blocking requests): slowdown "
          f"{gemm['slowdown']:+.1%}; the copies meanwhile {gemm['copy_GBps']:.1f} GB/s (store + load, "
          "whole requests inside the timed GEMMs)")
