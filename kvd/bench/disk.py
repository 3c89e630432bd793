"""``kvd bench --disk``: the disk tier against raw IO of the same bytes.

On one directory (``--disk-dir``): the disk tier (kvd.tiers.disk.tier: header, checksum, fsync,
rename; verified reads) against raw ``pwrite``+``fsync`` / ``pread`` of the same file sizes
on as many threads, alternating in rounds so a shared disk's slow spells hit both alike.
O_DIRECT where the directory takes it (said in the output). Prints median GB/s of
``--repeat`` runs and the ratio tier/raw. A benchmark: it asserts nothing.
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

from kvd.tiers.disk.chunk_file import file_size, probe_direct
from kvd.tiers.disk.tier import DiskTier

from .common import size_arg

NS = bytes(16)
ROUNDS = 16  # rounds per direction (at least 4 files per thread each)


def add_arguments(p) -> None:
    p.add_argument("--disk", action="store_true", help="benchmark the disk tier against raw "
                   "O_DIRECT IO of the same bytes (see --disk-*)")
    p.add_argument("--disk-dir", default="/tmp", help="with --disk: directory to benchmark in")
    p.add_argument("--disk-gib", type=float, default=1.0, help="with --disk: GiB written and read")
    p.add_argument("--disk-chunk", type=size_arg, default=4 * 2**20,
                   help="with --disk: bytes of one chunk (one file)")
    p.add_argument("--disk-threads", type=int, default=4, help="with --disk: IO threads")


def run(args) -> int:
    chunk, threads = args.disk_chunk, args.disk_threads
    n = max(1, int(args.disk_gib * 2**30 // chunk))
    base = Path(tempfile.mkdtemp(prefix="kvd-bench-disk-", dir=args.disk_dir))
    try:
        direct = probe_direct(base)
        mode = "O_DIRECT" if direct else "buffered (the filesystem refuses O_DIRECT)"
        per_round = max(4 * threads, -(-n // ROUNDS))
        print(f"kvd bench --disk: {base.parent}, {n} chunks of {chunk / 2**20:.2f} MiB "
              f"({n * chunk / 2**30:.2f} GiB), {threads} threads, {mode}, tier and raw "
              f"interleaved in rounds of {per_round} files, median of {args.repeat} runs",
              flush=True)
        # like host-tier slots: page-aligned (the tier then does no bounce copy under O_DIRECT)
        src = _aligned((min(n, 16), chunk))
        src[:] = np.random.default_rng(0).integers(0, 256, src.shape, dtype=np.uint8)
        dst = _aligned((min(n, 16), chunk))
        runs = {"tier write": [], "tier read": [], "raw write": [], "raw read": []}
        for i in range(args.repeat):
            secs = asyncio.run(_interleaved(base / f"run{i}", src, dst, n, threads, direct,
                                            per_round))
            for name, t in secs.items():
                runs[name].append(n * chunk / t / 1e9)
            shutil.rmtree(base / f"run{i}", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"{'direction':<10}{'disk tier GB/s':>16}{'raw GB/s':>12}{'tier/raw':>10}")
    for d in ("write", "read"):
        print(f"{d:<10}{med['tier ' + d]:>16.3f}{med['raw ' + d]:>12.3f}"
              f"{med['tier ' + d] / med['raw ' + d]:>10.2f}")
    if args.plot:
        from .plot import bars, command, machine
        bars(args.plot, f"kvd bench --disk: {chunk / 2**20:g} MiB chunks, {threads} threads, median of "
             f"{args.repeat}", ["write", "read"], {"disk tier": [med["tier write"], med["tier read"]],
                                                    "raw IO": [med["raw write"], med["raw read"]]},
             "GB/s", f"{machine()}; {args.disk_dir}; {command()}", fmt="{:.3f}")
        print(f"plot: {args.plot}")
    return 0


def _aligned(shape) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, shape[0] * shape[1]), np.uint8).reshape(shape)


def assert_same(src, dst) -> None:
    if not np.array_equal(src, dst):
        raise RuntimeError("disk tier read back different bytes")  # never expected


async def _interleaved(root: Path, src, dst, n: int, threads: int, direct: bool,
                       per_round: int) -> dict:
    """Seconds of each side: writes (then reads) go in rounds of ``per_round`` files,
    tier then raw or raw then tier (alternating), so a noisy shared disk's slow
    spells hit both sides alike."""
    tier = DiskTier(root / "tier", capacity=2 * n * file_size(src.shape[1]), threads=threads,
                    queue_chunks=n, direct=direct)
    raw = _Raw(root / "raw", src, threads, direct)
    keys = [i.to_bytes(16, "big") for i in range(n)]
    secs = dict.fromkeys(("tier write", "tier read", "raw write", "raw read"), 0.0)
    loop = asyncio.get_running_loop()

    async def tier_write(idx):
        futs = [tier.submit_write(NS, keys[i], src[i % len(src)], 1, src.shape[1]) for i in idx]
        if not all(await asyncio.gather(*futs)):
            raise RuntimeError(f"disk tier writes failed: {tier.stats()}")

    async def tier_read(idx):
        if not all(await asyncio.gather(*(tier.read_into(tier.get(keys[i]), dst[i % len(dst)])
                                          for i in idx))):
            raise RuntimeError(f"disk tier reads failed: {tier.stats()}")

    sides = {"write": (tier_write, raw.write), "read": (tier_read, raw.read)}
    try:
        for what, (tier_op, raw_op) in sides.items():
            for r, first in enumerate(range(0, n, per_round)):
                idx = list(range(first, min(n, first + per_round)))
                for side in (("tier", "raw") if r % 2 == 0 else ("raw", "tier")):
                    t0 = time.perf_counter()
                    if side == "tier":
                        await tier_op(idx)
                    else:
                        await loop.run_in_executor(None, raw_op, idx)
                    secs[f"{side} {what}"] += time.perf_counter() - t0
                if what == "read":  # untimed: what the tier read is what was written
                    assert_same(src[[i % len(src) for i in idx[:len(src)]]],
                                dst[[i % len(dst) for i in idx[:len(dst)]]])
    finally:
        await tier.close()
        raw.close()
    return secs


class _Raw:
    """Raw IO of whole files the size of chunk files: one pwrite + fsync, one pread."""

    def __init__(self, root: Path, src, threads: int, direct: bool):
        root.mkdir(parents=True)
        self.root, self.size = root, file_size(src.shape[1])
        self.flags = os.O_DIRECT if direct else 0
        self.pool = ThreadPoolExecutor(threads)
        self.local = threading.local()
        self.src = src

    def _buf(self):
        if getattr(self.local, "buf", None) is None:
            self.local.buf = mmap.mmap(-1, self.size)
            memoryview(self.local.buf)[4096:4096 + self.src.shape[1]] = self.src[0]
        return self.local.buf

    def _write_one(self, i: int) -> None:
        fd = os.open(self.root / f"{i}.raw", os.O_WRONLY | os.O_CREAT | self.flags, 0o600)
        try:
            os.pwrite(fd, self._buf(), 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read_one(self, i: int) -> None:
        fd = os.open(self.root / f"{i}.raw", os.O_RDONLY | self.flags)
        try:
            os.preadv(fd, [self._buf()], 0)
        finally:
            os.close(fd)

    def write(self, idx: list) -> None:
        list(self.pool.map(self._write_one, idx))

    def read(self, idx: list) -> None:
        list(self.pool.map(self._read_one, idx))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
