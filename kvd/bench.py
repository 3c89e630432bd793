"""``kvd bench``: store and load throughput through a private daemon.

Starts ``kvd serve`` in a subprocess on a temporary runtime dir, registers
a shared-memory pool with the host backend, and times end-to-end
``store`` (engine pages -> host tier) and ``load`` (host tier -> other
pages) of the same chunks, each next to a plain numpy copy of the same
number of bytes measured in the same run (``--gpu``: kvd.bench_gpu;
``--disk``: kvd.bench_disk; ``--gds``: kvd.bench_gds; ``--disk-policy``: kvd.bench_policy). Prints medians of ``--repeat``
runs and the ratios. A benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from .keys import DTYPE_SIZES


def add_arguments(p) -> None:
    p.add_argument("--layout", default="vllm_flash_attn", help="engine layout of the pool")
    p.add_argument("--layers", type=int, default=32, help="model layers")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (1 for MLA layouts)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (latent width for MLA)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_SIZES), help="KV dtype")
    p.add_argument("--page-size", type=int, default=16, help="tokens per engine page")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per cached chunk")
    p.add_argument("--chunks", type=int, default=8, help="chunks per store/load request")
    p.add_argument("--repeat", type=int, default=5, help="timed runs; the median is reported")
    p.add_argument("--daemon-log", default=None, metavar="PATH", help="write the private daemon's "
                   "debug log (per-copy timings) to PATH; summarise it with tools/daemon_timings.py")
    p.add_argument("--gpu", action="store_true", help="benchmark the CUDA path (needs torch, cupy, "
                   "a GPU): Llama-3-8B and DeepSeek-MLA shaped pools vs pinned cudaMemcpy")
    p.add_argument("--spin-ms", type=float, default=0.0, help="with --gpu: the clients busy-poll "
                   "this long for each reply before sleeping (KvdClient spin_s)")
    p.add_argument("--gpu-page-sizes", type=lambda v: [int(x) for x in v.split(",")],
                   default=[1, 16, 64, 256], help="with --gpu: comma-separated page sizes")
    p.add_argument("--gds", action="store_true", help="benchmark loads of disk-only chunks into "
                   "GPU pages, GPU Direct Storage vs the host tier path vs raw O_DIRECT reads (needs "
                   "torch, cupy, KvikIO, a GPU; uses --disk-dir, --disk-gib, --disk-threads, --chunks)")
    from .bench_disk import add_arguments as add_disk_arguments
    from .bench_policy import add_arguments as add_policy_arguments
    add_disk_arguments(p)
    add_policy_arguments(p)


def run(args) -> int:
    if args.disk_policy:
        from .bench_policy import run as run_policy
        return run_policy(args)
    if args.gds:
        from .bench_gds import run as run_gds
        return run_gds(args)
    if args.disk:
        from .bench_disk import run as run_disk
        return run_disk(args)
    if args.gpu:
        from .bench_gpu import run as run_gpu
        return run_gpu(args)
    from kvd_client import KvdClient, SharedKVPool

    row = args.kv_heads * args.head_dim * DTYPE_SIZES[args.dtype]
    planes = 1 if args.layout.endswith("mla") else 2
    shard = args.layers * planes * args.chunk_tokens * row
    nbytes = shard * args.chunks
    ppc = args.chunk_tokens // args.page_size
    pages = 2 * args.chunks * ppc
    print(f"kvd bench: {args.layout}, {args.layers} layers, row {row} B, page {args.page_size} tokens, "
          f"{args.chunks} chunks of {shard / 2**20:.1f} MiB = {nbytes / 2**20:.0f} MiB per request",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as rundir:
        daemon = _start_daemon(rundir, capacity=int(nbytes * 2.5) + 2**20, chunk_tokens=args.chunk_tokens,
                               log_path=args.daemon_log)
        pool = None
        try:
            client = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True, heartbeat=False).connect()
            pool = SharedKVPool(args.layout, args.layers, pages, args.page_size, args.kv_heads,
                                args.head_dim, args.dtype)
            pool.raw[:] = np.random.default_rng(0).integers(0, 256, pool.raw.size, dtype=np.uint8)
            client.register_kv(pool, model="kvd-bench")
            results = _measure(client, args, ppc, nbytes)
            client.close()
        finally:
            if pool is not None:
                pool.close()
            daemon.terminate()
            daemon.wait(30)
    _report(results, nbytes)
    return 0


def control(rundir: str, op: str, timeout: float = 300.0):
    """One control-socket request (``stats``, ``clear``, ``flush_disk``...) to the private daemon."""
    from pathlib import Path

    from kvd_client.transport import Channel

    from .runtime import control_endpoint
    ch = Channel(control_endpoint(Path(rundir)), timeout)
    try:
        return ch.request(op)
    finally:
        ch.close()


def _start_daemon(rundir: str, capacity: int, chunk_tokens: int, extra=(),
                  log_path: str | None = None) -> subprocess.Popen:
    """The private daemon; with ``log_path`` it logs at debug level into that file."""
    level = "debug" if log_path else "warning"
    cmd = [sys.executable, "-m", "kvd", "serve", "--runtime-dir", rundir, "--host-capacity",
           str(capacity), "--chunk-tokens", str(chunk_tokens), "--log-level", level, *extra]
    log = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(rundir, "control.sock")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the benchmark daemon did not start")
        time.sleep(0.05)
    return proc


def _measure(client, args, ppc: int, nbytes: int) -> dict:
    src_pages = np.arange(args.chunks * ppc)
    dst_pages = src_pages + args.chunks * ppc
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    out = {"store": [], "load": [], "numpy copy": []}
    for i in range(args.repeat + 1):  # the first run warms up and is dropped
        tokens = np.arange(args.chunks * args.chunk_tokens) + i * 10**6
        t0 = time.perf_counter()
        stored = client.store(tokens, src_pages)
        t1 = time.perf_counter()
        loaded = client.load(tokens, dst_pages)
        t2 = time.perf_counter()
        np.copyto(b, a)
        t3 = time.perf_counter()
        if stored != len(tokens) or loaded != len(tokens):
            raise RuntimeError(f"stored {stored} and loaded {loaded} of {len(tokens)} tokens")
        if i:
            out["store"].append(t1 - t0)
            out["load"].append(t2 - t1)
            out["numpy copy"].append(t3 - t2)
        print(f"  run {i}{' (warm-up)' if not i else ''}: store {nbytes / (t1 - t0) / 1e9:.2f} GB/s, "
              f"load {nbytes / (t2 - t1) / 1e9:.2f} GB/s, numpy {nbytes / (t3 - t2) / 1e9:.2f} GB/s",
              flush=True)
    return out


def _report(results: dict, nbytes: int) -> None:
    base = statistics.median(results["numpy copy"])
    print(f"\n{'what':<12}{'median ms':>11}{'GB/s':>9}{'vs numpy copy':>15}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:<12}{med * 1e3:>11.2f}{nbytes / med / 1e9:>9.2f}{base / med:>14.0%}")
