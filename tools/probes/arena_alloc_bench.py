#!/usr/bin/env python3
"""How fast the host arena is made and adopted (kvd/tiers/host/arena.py), by populating threads.

For each thread count of ``--threads`` (alternating, ``--repeat`` rounds) it makes a new
arena of ``--gib`` GiB in ``--dir`` (MADV_POPULATE_WRITE: allocate and zero every page),
closes it keeping the file, maps it again as a restarted daemon adopts it
(MADV_POPULATE_READ), and deletes it. The row ``before`` is the method this replaced, in
the same rounds: posix_fallocate then MADV_POPULATE_WRITE per 64 MiB piece on one thread
(and POPULATE_WRITE to map an existing file again). The order of the variants rotates
from round to round. Prints the medians in seconds and GiB/s and how
much of the mapping the kernel gave huge pages (a tmpfs mounted ``huge=advise`` or
``within_size``: ``mount -o remount,huge=advise /dev/shm``; compare with a run on a
plain /dev/shm). Usage (the GPU machine: ``--gib 64 --threads 1,4,8,16``):
``.venv/bin/python tools/probes/arena_alloc_bench.py [--dir /dev/shm] [--gib 4] [--threads 1,2]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from pathlib import Path

from kvd.tiers.host.arena import MADV_HUGEPAGE, MADV_POPULATE_WRITE, PIECE, SharedArena


def once(path: Path, size: int, threads: int) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    arena = SharedArena(path, size, threads=threads)
    made = time.perf_counter() - t0
    huge = arena.huge_pages / size
    arena.close(keep=True)
    t0 = time.perf_counter()
    arena = SharedArena(path, size, adopt=True, threads=threads)
    arena.wait_populated()  # adoption serves at once; this is the mapping-in behind it
    adopted = time.perf_counter() - t0
    arena.close(keep=False)
    return made, adopted, huge


def before(path: Path, size: int) -> tuple[float, float, float]:
    """The previous allocation: fallocate + POPULATE_WRITE per piece, one thread."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        t0 = time.perf_counter()
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        m.madvise(MADV_HUGEPAGE)
        for off in range(0, size, PIECE):
            os.posix_fallocate(fd, off, min(PIECE, size - off))
            m.madvise(MADV_POPULATE_WRITE, off, min(PIECE, size - off))
        made = time.perf_counter() - t0
        m.close()
        t0 = time.perf_counter()
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        for off in range(0, size, PIECE):
            m.madvise(MADV_POPULATE_WRITE, off, min(PIECE, size - off))
        adopted = time.perf_counter() - t0
        m.close()
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return made, adopted, 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm", help="the tmpfs to make the arena in")
    ap.add_argument("--gib", type=float, default=4.0, help="arena size in GiB")
    ap.add_argument("--threads", default="1,2", help="populating thread counts, comma-separated")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (variants alternate)")
    args = ap.parse_args()
    size = int(args.gib * 2**30)
    counts = [int(t) for t in args.threads.split(",")]
    runs: dict = {"before": [], **{t: [] for t in counts}}
    path = Path(args.dir) / f"alloc-bench-{os.getpid()}"  # not kvd-*: test suites sweep those
    try:
        variants = list(runs)
        for r in range(args.repeat):  # the order rotates: memory just freed is reused faster
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                runs[v].append(before(path, size) if v == "before" else once(path, size, v))
    finally:
        path.unlink(missing_ok=True)
    print(f"arena of {args.gib:g} GiB in {args.dir}, median of {args.repeat} (cores: "
          f"{os.cpu_count()})")
    print(f"{'threads':>8}{'new s':>8}{'GiB/s':>8}{'adopt s':>9}{'GiB/s':>8}{'huge':>7}")
    for t, rows in runs.items():
        made = statistics.median(r[0] for r in rows)
        adopted = statistics.median(r[1] for r in rows)
        huge = statistics.median(r[2] for r in rows)
        huge_text = "" if t == "before" else f"{huge:>7.0%}"
        print(f"{t:>8}{made:>8.2f}{args.gib / made:>8.2f}{adopted:>9.2f}{args.gib / adopted:>8.2f}"
              f"{huge_text}")


if __name__ == "__main__":
    main()
