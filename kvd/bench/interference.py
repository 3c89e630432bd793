"""``kvd bench --gpu --interference``: what kvd's copies cost an engine's compute.

Three processes as in production: the private daemon, an engine that only computes (a
bf16 GEMM or a decode-like CUDA graph) and a copier client that keeps stores and loads in
flight. The engine times its work alone and busy in alternating windows: slowdown = median
busy / median alone. Per daemon copy-path variant: slowdown, copy GB/s meanwhile, and the
copier's pinned cudaMemcpy rate alone. ``--mps`` repeats under CUDA MPS. Not a test.
"""

from __future__ import annotations

import itertools
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from .common import request_bytes, start_daemon, stop_daemon, without_gpu_stack
from .gpu import SHAPES

_K = ["--gpu-copy-path", "kernels"]
_D = ["--gpu-copy-path", "dma"]
_STAGED = [*_D, "--gpu-dma-stage-below", "64KiB"]  # DMA through the slots
VARIANTS = {  # name -> (daemon flags, copier options)
    "none (control)": (_D, {"idle": True}),
    "auto (default)": ([], {}),  # the daemon's own choice: DMA where pages are byte ranges
    "dma": (_D, {}),
    "dma, stores only": (_D, {"direction": "d2h"}),
    "dma, loads only": (_D, {"direction": "h2d"}),
    "dma, no marks": (_D, {"marks": False}),
    "dma, staged": (_STAGED, {}),
    "dma, staged, stores only": (_STAGED, {"direction": "d2h"}),
    "dma, staged, loads only": (_STAGED, {"direction": "h2d"}),
    "dma, spread": ([*_D, "--gpu-dma-spread-below", "1GiB"], {}),  # every copy over 8 streams
    "dma, 4 streams": ([*_D, "--gpu-dma-streams", "4", "--gpu-dma-spread-below", "1GiB"], {}),
    "dma, 16 streams": ([*_D, "--gpu-dma-streams", "16", "--gpu-dma-spread-below", "1GiB"], {}),
    "staged, 32 blocks": ([*_K, "--gpu-max-blocks", "32"], {}),
    "staged, 8 blocks": ([*_K, "--gpu-max-blocks", "8"], {}),
    "staged, 128 blocks": ([*_K, "--gpu-max-blocks", "128"], {}),
    "staged, full width": ([*_K, "--gpu-max-blocks", "1024"], {}),
    "staged, 4 x 64 MiB slots": ([*_K, "--gpu-max-blocks", "32", "--gpu-stage-slots", "4",
                                  "--gpu-stage-slot-bytes", "64MiB"], {}),
    "staged, 8 blocks, 4 x 64 MiB slots": ([*_K, "--gpu-max-blocks", "8", "--gpu-stage-slots", "4",
                                            "--gpu-stage-slot-bytes", "64MiB"], {}),
    "staged, poll 200 us": ([*_K, "--gpu-max-blocks", "32", "--gpu-poll-interval-us", "200"], {}),
    "staged, no marks": ([*_K, "--gpu-max-blocks", "32"], {"marks": False}),
    "zero-copy, 32 blocks": ([*_K, "--gpu-max-blocks", "32", "--gpu-stage-slots", "0"], {}),
    "zero-copy, 8 blocks": ([*_K, "--gpu-max-blocks", "8", "--gpu-stage-slots", "0"], {}),
    "zero-copy, full width": ([*_K, "--gpu-max-blocks", "1024", "--gpu-stage-slots", "0"], {}),
}
SAMPLES = 15
ROUNDS = 4     # alone / busy turns of the engine
WARMUP_S = 2.0  # the engine computes this long first, so the GPU clocks are up


def run(args) -> int:
    unknown = [v for v in args.interference_variants or [] if v not in VARIANTS]
    unknown += [w for w in args.interference_workloads if w not in ("gemm", "decode")]
    if unknown:
        print(f"kvd bench --interference: unknown variant or workload {', '.join(map(repr, unknown))}"
              f"; variants: {'; '.join(VARIANTS)}; workloads: gemm, decode", file=sys.stderr)
        return 2
    if without_gpu_stack("--gpu --interference"):
        return 2
    rows = []
    print(f"interference: shape {args.gpu_shapes[0]} {SHAPES[args.gpu_shapes[0]]}, "
          f"pool {args.gpu_pool[0]}", flush=True)
    modes = [False] + ([True] if args.mps else [])
    for mps in modes:
        if mps and not _start_mps():
            print("CUDA MPS: nvidia-cuda-mps-control is not available here; skipped")
            continue
        try:
            for name in args.interference_variants or list(VARIANTS):
                flags, copier = VARIANTS[name]
                for workload in args.interference_workloads:
                    rows.append({"variant": name, "mps": mps, "workload": workload,
                                 **_one(args, flags, copier, workload)})
                    _print_row(rows[-1])
        finally:
            if mps:
                _stop_mps()
    _report(rows)
    return 0


def _one(args, flags: list, copier_opts: dict, workload: str) -> dict:
    ctx = multiprocessing.get_context("spawn")
    chunk, shape = args.chunk_tokens, SHAPES[args.gpu_shapes[0]]
    nbytes = request_bytes(shape, args.chunks, chunk)
    with tempfile.TemporaryDirectory(prefix="kvd-ibench-") as rundir:
        daemon = start_daemon(rundir, capacity=8 * nbytes + 2**24, chunk_tokens=chunk,
                              extra=["--gpu", "on", *flags])
        try:
            to_engine, engine_end = ctx.Pipe()
            to_copier, copier_end = ctx.Pipe()
            engine = ctx.Process(target=_engine, args=(workload, engine_end))
            copier = ctx.Process(target=_copier, args=(rundir, args.chunks, chunk,
                                                       {**copier_opts, "alloc": args.gpu_pool[0], "shape": shape},
                                                       copier_end))
            copier.start()
            copier_end.close()                    # a dead child's pipe reads EOF, not a hang
            memcpy_Bps = to_copier.recv()         # the copier's memcpy, with the GPU to itself
            engine.start()
            engine_end.close()
            to_engine.recv()                      # warmed up: the GPU's clocks are up
            alone, busy = _rounds(to_engine, to_copier)
            to_copier.send(("stop", [b["window"] for b in busy]))
            moved, seconds = to_copier.recv()
            to_engine.send("stop")
            copier.join(60)
            engine.join(60)
        finally:
            stop_daemon(daemon, rundir, 60)
    base = statistics.median(alone)
    busy_ms = statistics.median(b["ms"] for b in busy)
    return {"alone_ms": base, "busy_ms": busy_ms, "slowdown": busy_ms / base - 1,
            "alone_spread": (max(alone) - min(alone)) / base,
            "copy_GBps": moved / seconds / 1e9 if seconds else 0.0,
            "copy_ratio": moved / seconds / memcpy_Bps if seconds else 0.0,
            "memcpy_GBps": memcpy_Bps / 1e9}


def _rounds(to_engine, to_copier) -> tuple:
    """The engine alone and busy in turns, ROUNDS times, then alone once more:
    clock drift and other tenants touch both sides alike."""
    alone, busy = [], []
    for _ in range(ROUNDS):
        to_engine.send("measure")
        alone.append(to_engine.recv()["ms"])
        to_copier.send("go")
        to_copier.recv()                          # "copying": copies in flight
        to_engine.send("measure")
        busy.append(to_engine.recv())
        to_copier.send("pause")
        to_copier.recv()                          # "paused": nothing in flight
    to_engine.send("measure")
    alone.append(to_engine.recv()["ms"])
    return alone, busy


def _engine(workload: str, pipe) -> None:
    import torch
    step = _gemm(torch) if workload == "gemm" else _decode(torch)
    t_end = time.monotonic() + WARMUP_S
    while time.monotonic() < t_end:
        step()
        torch.cuda.synchronize()
    pipe.send("ready")
    while pipe.recv() == "measure":
        t0 = time.monotonic()
        ms = statistics.median(_sample(torch, step) for _ in range(SAMPLES))
        pipe.send({"ms": ms, "window": (t0, time.monotonic())})


def _sample(torch, step, iters: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _gemm(torch):
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return lambda: a @ b


def _decode(torch):
    """Replayed as one CUDA graph, as serving engines run decode steps: launched
    kernel by kernel from Python the step timed the host, not the GPU."""
    w = [torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda") for _ in range(32)]
    x = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")

    def step():
        h = x
        for layer in w:
            h = torch.nn.functional.gelu(h @ layer)
        return h
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _copier(rundir: str, chunks: int, chunk: int, opts: dict, pipe) -> None:
    import numpy as np
    import torch

    from kvd.bench.gpu import make_pool, memcpy_s
    from kvd_client import KvdClient
    from kvd_client.torch_pool import CudaKVPool
    shape = tuple(opts["shape"])
    nbytes = request_bytes(shape, chunks, chunk)
    # Stores and loads in turns run both ways at once: then the baseline is both ways.
    way = opts.get("direction", "both")
    pipe.send((2 if way == "both" else 1) * nbytes / memcpy_s(torch, nbytes, 5)[way])
    ppc = chunk // 16
    pool = make_pool(torch, CudaKVPool, shape, 2 * chunks * ppc, 16, opts.get("alloc", "per-layer"))
    client = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True, heartbeat=False).connect()
    client.register_kv(pool, model="bench-interference")
    if not opts.get("marks", True):  # diagnosis: copies not ordered after this stream
        client._mark = lambda transfer: None
    src, dst = np.arange(chunks * ppc), np.arange(chunks * ppc, 2 * chunks * ppc)
    cached = np.arange(chunks * chunk) + 10**8
    client.store(cached, src)
    torch.cuda.synchronize()
    turns, fresh = itertools.count(), itertools.count(10**9, chunks * chunk)

    def submit():
        if way == "h2d" or (way == "both" and next(turns) % 2):
            return client.submit_load(cached, dst)
        return client.submit_store(np.arange(chunks * chunk) + next(fresh), src)

    landed = []
    while (msg := pipe.recv()) == "go":
        if opts.get("idle"):                      # the control: turns, but no copies
            pipe.send("copying")
            pipe.poll(None)
        else:
            _copy_until_told(client, pipe, submit, landed, nbytes)
        pipe.recv()                               # "pause"
        pipe.send("paused")
    windows = msg[1]
    inside = sum(b for at, b in landed if any(t0 <= at <= t1 for t0, t1 in windows))
    client.close()
    pipe.send((inside, sum(t1 - t0 for t0, t1 in windows)))


def _copy_until_told(client, pipe, submit, landed: list, nbytes: int) -> None:
    """Keep 4 copies in flight until the parent speaks, then drain them; each landing
    goes to ``landed`` as (time, bytes). Says "copying" once the first lands (the
    pipeline is full: time the engine now)."""
    inflight, first = [], len(landed)
    while not pipe.poll() or inflight:
        if not pipe.poll() and len(inflight) < 4:
            inflight.append(submit())
        for t in client.poll():
            inflight.remove(t)
            if not t.ok:
                raise RuntimeError(f"a copy failed during the interference run: {t}")
            landed.append((time.monotonic(), nbytes))
            if len(landed) == first + 1:
                pipe.send("copying")
        client.progress(None, 0.0005)


def _start_mps() -> bool:
    if shutil.which("nvidia-cuda-mps-control") is None:
        return False
    return subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True).returncode == 0


def _stop_mps() -> None:
    subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", capture_output=True)
    time.sleep(1)


def _print_row(r: dict) -> None:
    print(f"  {r['variant']:<26}{' MPS' if r['mps'] else '':<5}{r['workload']:<8}"
          f"alone {r['alone_ms']:.3f} ms (alone spread {r['alone_spread']:.1%}), with "
          f"copies {r['busy_ms']:.3f} ms ({r['slowdown']:+.1%}); "
          f"copies {r['copy_GBps']:.1f} GB/s = {r['copy_ratio']:.2f} of memcpy "
          f"({r['memcpy_GBps']:.1f} GB/s)", flush=True)


def _report(rows: list) -> None:
    print("\ninterference: engine and copier in separate processes; slowdown of the engine's "
          "step while kvd copies; copy GB/s inside that window, ratio to the copier's memcpy")
    width = max([24, *(len(r["variant"]) + 2 for r in rows)])
    print(f"{'variant':<{width}}{'MPS':<5}{'workload':<9}{'alone ms':>9}{'busy ms':>9}{'slowdown':>10}"
          f"{'noise':>7}{'copy GB/s':>10}{'ratio':>7}{'memcpy':>8}")
    for r in rows:
        print(f"{r['variant']:<{width}}{'yes' if r['mps'] else 'no':<5}{r['workload']:<9}"
              f"{r['alone_ms']:>9.3f}{r['busy_ms']:>9.3f}{r['slowdown']:>+10.1%}{r['alone_spread']:>7.1%}"
              f"{r['copy_GBps']:>10.1f}{r['copy_ratio']:>7.2f}{r['memcpy_GBps']:>8.1f}")
    sys.stdout.flush()
