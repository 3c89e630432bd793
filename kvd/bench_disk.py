"""``kvd bench --disk``: the disk tier against raw IO of the same bytes.

In one run, on one directory (``--disk-dir``), for ``--disk-gib`` GiB of
chunks of ``--disk-chunk`` bytes each: (1) the disk tier (kvd.disk_tier:
temp file, header, xxh3 checksum, fsync, rename; reads verify the header
and checksum and copy into the destination) with ``--disk-threads`` IO
threads; (2) raw IO of the same file sizes in the same block size with the
same number of threads: one ``pwrite`` + ``fsync`` per file, one ``pread``
per file. Both use O_DIRECT when the directory takes it and buffered IO
otherwise (said in the output). Prints the median GB/s of ``--repeat``
runs and the ratio tier/raw. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .config import parse_size
from .disk_file import file_size, probe_direct
from .disk_tier import DiskTier

NS = bytes(16)


def add_arguments(p) -> None:
    p.add_argument("--disk", action="store_true", help="benchmark the disk tier against raw "
                   "O_DIRECT IO of the same bytes (see --disk-*)")
    p.add_argument("--disk-dir", default="/tmp", help="with --disk: directory to benchmark in")
    p.add_argument("--disk-gib", type=float, default=1.0, help="with --disk: GiB written and read")
    p.add_argument("--disk-chunk", type=parse_size, default=4 * 2**20,
                   help="with --disk: bytes of one chunk (one file)")
    p.add_argument("--disk-threads", type=int, default=4, help="with --disk: IO threads")


def run(args) -> int:
    chunk, threads = args.disk_chunk, args.disk_threads
    n = max(1, int(args.disk_gib * 2**30 // chunk))
    base = Path(tempfile.mkdtemp(prefix="kvd-bench-disk-", dir=args.disk_dir))
    try:
        direct = probe_direct(base)
        mode = "O_DIRECT" if direct else "buffered (the filesystem refuses O_DIRECT)"
        print(f"kvd bench --disk: {base.parent}, {n} chunks of {chunk / 2**20:.2f} MiB "
              f"({n * chunk / 2**30:.2f} GiB), {threads} threads, {mode}, median of "
              f"{args.repeat} runs", flush=True)
        # like host-tier slots: page-aligned (the tier then does no bounce copy under O_DIRECT)
        src = _aligned((min(n, 16), chunk))
        src[:] = np.random.default_rng(0).integers(0, 256, src.shape, dtype=np.uint8)
        dst = _aligned((min(n, 16), chunk))
        runs = {"tier write": [], "tier read": [], "raw write": [], "raw read": []}
        for i in range(args.repeat):
            if i % 2:  # alternate which goes first, so neither always meets a busier device
                rw, rr = _raw(base / f"raw{i}", src, n, threads, direct)
            tw, tr = asyncio.run(_tier(base / f"tier{i}", src, dst, n, threads, direct))
            assert_same(src, dst)
            if not i % 2:
                rw, rr = _raw(base / f"raw{i}", src, n, threads, direct)
            for name, secs in (("tier write", tw), ("tier read", tr), ("raw write", rw),
                               ("raw read", rr)):
                runs[name].append(n * chunk / secs / 1e9)
            shutil.rmtree(base / f"tier{i}", ignore_errors=True)
            shutil.rmtree(base / f"raw{i}", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"{'direction':<10}{'disk tier GB/s':>16}{'raw GB/s':>12}{'tier/raw':>10}")
    for d in ("write", "read"):
        print(f"{d:<10}{med['tier ' + d]:>16.3f}{med['raw ' + d]:>12.3f}"
              f"{med['tier ' + d] / med['raw ' + d]:>10.2f}")
    return 0


def _aligned(shape) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, shape[0] * shape[1]), np.uint8).reshape(shape)


def assert_same(src, dst) -> None:
    if not np.array_equal(src, dst):
        raise RuntimeError("disk tier read back different bytes")  # never expected


async def _tier(root: Path, src, dst, n: int, threads: int, direct: bool):
    tier = DiskTier(root, capacity=2 * n * file_size(src.shape[1]), threads=threads,
                    queue_chunks=n, direct=direct)
    keys = [i.to_bytes(16, "big") for i in range(n)]
    t0 = time.perf_counter()
    futs = [tier.submit_write(NS, k, src[i % len(src)], 1, src.shape[1]) for i, k in enumerate(keys)]
    ok = await asyncio.gather(*futs)
    write_s = time.perf_counter() - t0
    if not all(ok):
        raise RuntimeError(f"disk tier writes failed: {tier.stats()}")
    t0 = time.perf_counter()
    ok = await asyncio.gather(*(tier.read_into(tier.get(k), dst[i % len(dst)])
                                for i, k in enumerate(keys)))
    read_s = time.perf_counter() - t0
    if not all(ok):
        raise RuntimeError(f"disk tier reads failed: {tier.stats()}")
    await tier.close()
    return write_s, read_s


def _raw(root: Path, src, n: int, threads: int, direct: bool):
    root.mkdir()
    size = file_size(src.shape[1])
    flags = os.O_DIRECT if direct else 0
    local = threading.local()

    def buf():
        if getattr(local, "buf", None) is None:
            local.buf = mmap.mmap(-1, size)
            memoryview(local.buf)[4096:4096 + src.shape[1]] = src[0]
        return local.buf

    def write(i):
        fd = os.open(root / f"{i}.raw", os.O_WRONLY | os.O_CREAT | flags, 0o600)
        try:
            os.pwrite(fd, buf(), 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(i):
        fd = os.open(root / f"{i}.raw", os.O_RDONLY | flags)
        try:
            os.preadv(fd, [buf()], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(write, range(n)))
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(pool.map(read, range(n)))
        read_s = time.perf_counter() - t0
    return write_s, read_s
