"""``kvd bench --gds``: disk-only chunks into GPU pages, GPU Direct Storage vs the host path.

One private daemon per mode on ``--disk-dir``: chunks stored from a GPU pool, written to
disk and dropped from host; each mode (GDS; host promote + staged copy) loads every
request ``--repeat`` times with page cache dropped before each run, checking the last
load bit for bit. Baseline: raw O_DIRECT reads of the same files into host memory.
Prints median GB/s and ratios; asserts nothing on speed.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

SHAPE = ("vllm_flash_attn", 32, 8, 128)  # layout, layers, kv heads, head dim (bf16)
PAGE = 16


def run(args) -> int:
    import torch

    from kvd.bench.common import control, request_bytes, start_daemon, stop_daemon
    from kvd_client import KvdClient
    from kvd_client.torch_pool import CudaKVPool

    torch.cuda.init()
    chunk, per = args.chunk_tokens, args.chunks
    req_bytes = request_bytes(SHAPE, per, chunk)
    requests = max(1, int(args.disk_gib * 2**30 // req_bytes))
    total = requests * req_bytes
    ppc = chunk // PAGE
    base = Path(tempfile.mkdtemp(prefix="kvd-bench-gds-", dir=args.disk_dir))
    print(f"kvd bench --gds: {base.parent}, {requests} requests of {per} chunks "
          f"({req_bytes / 2**20:.0f} MiB, Llama-3-8B shape), {total / 2**30:.2f} GiB, median of "
          f"{args.repeat} runs", flush=True)
    _, layers, heads, dim = SHAPE
    tensors = [torch.randn(2, 2 * per * ppc, PAGE, heads, dim, dtype=torch.bfloat16, device="cuda")
               for _ in range(layers)]
    pool = CudaKVPool(SHAPE[0], tensors)
    src, dst = list(range(per * ppc)), list(range(2 * per * ppc - 1, per * ppc - 1, -1))
    seqs = [np.arange(per * chunk) + r * 10**7 for r in range(requests)]
    runs: dict = {"gds": [], "host path": [], "raw read": []}
    try:
        for mode in ("gds", "host path"):
            rundir = tempfile.mkdtemp(prefix="kvd-gds-run-")
            knobs = ["--gpu", "on", "--disk-dir", str(base / "disk"), "--disk-capacity",
                     str(total * 2), "--disk-io-threads", str(args.disk_threads),
                     "--disk-gds", "true" if mode == "gds" else "false"]
            daemon = start_daemon(rundir, capacity=total + req_bytes * 2, chunk_tokens=chunk,
                                   extra=knobs, log_path=args.daemon_log)
            try:
                client = KvdClient(runtime_dir=rundir, timeout=300, raise_errors=True,
                                   heartbeat=False).connect()
                client.register_kv(pool, model="kvd-bench-gds")
                if mode == "gds":
                    torch.cuda.synchronize()
                    for tokens in seqs:
                        client.store(tokens, src)
                    control(rundir, "flush_disk")
                else:
                    _wait_recovered(rundir)
                want = [t[:, src].clone() for t in tensors]
                for _ in range(args.repeat):
                    control(rundir, "clear")
                    _drop_cache(base / "disk")
                    t0 = time.perf_counter()
                    loaded = sum(client.load(tokens, dst) for tokens in seqs)
                    torch.cuda.synchronize()
                    runs[mode].append(total / (time.perf_counter() - t0) / 1e9)
                    if loaded != requests * per * chunk:
                        raise RuntimeError(f"{mode}: loaded {loaded} tokens of {requests * per * chunk}")
                    if mode == "host path" or len(runs["raw read"]) < args.repeat:
                        runs["raw read"].append(_raw_read(base / "disk", args.disk_threads))
                if not all(torch.equal(t[:, dst].view(torch.uint8), w.view(torch.uint8))
                           for t, w in zip(tensors, want)):
                    raise RuntimeError(f"{mode}: loaded pages differ from the stored ones")
                stats = control(rundir, "stats")["tiers"]["disk"]
                print(f"  {mode}: gds {stats['gds']}, promotions {stats['promotions']}", flush=True)
                client.close()
            finally:
                stop_daemon(daemon, rundir, 60)
                shutil.rmtree(rundir, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"{'path':<12}{'GB/s':>8}{'vs raw O_DIRECT read':>24}")
    for k in ("gds", "host path", "raw read"):
        print(f"{k:<12}{med[k]:>8.2f}{med[k] / med['raw read']:>24.2f}")
    if args.plot:
        from .plot import bars, command, machine
        paths = ["gds", "host path", "raw read"]
        bars(args.plot, f"kvd bench --gds: disk-only chunks into GPU pages, median of {args.repeat}",
             paths, {"GB/s": [med[k] for k in paths]}, "GB/s", f"{machine()}; {command()}")
        print(f"plot: {args.plot}")
    return 0


def _wait_recovered(rundir: str) -> None:
    from kvd.bench.common import control
    while control(rundir, "stats")["tiers"]["disk"]["recovery"]["state"] != "done":
        time.sleep(0.1)


def _chunk_files(root: Path) -> list:
    return sorted(root.rglob("*.kvc"))


def _drop_cache(root: Path) -> None:
    for path in _chunk_files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_read(root: Path, threads: int) -> float:
    """GB/s of O_DIRECT reads of every chunk file (whole files, one read each)."""
    import mmap
    import threading
    files = _chunk_files(root)
    size = os.path.getsize(files[0])
    local = threading.local()

    def read(path):
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, size)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)

    _drop_cache(root)
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(read, files))
        secs = time.perf_counter() - t0
    return len(files) * size / secs / 1e9
