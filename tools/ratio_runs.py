#!/usr/bin/env python3
"""Every run's ratio to memcpy, pooled over several `kvd bench --gpu --json` files.

    python3 tools/ratio_runs.py OUT/new-1.json OUT/new-2.json OUT/off-1.json ...
    python3 tools/ratio_runs.py OUT              (every *.json in OUT)
    python3 tools/ratio_runs.py OUT --base off   (each variant against ``off``)

A file's variant is its name less a trailing ``-<round>`` (``new-3.json``:
``new``), as tools/ab_runs.sh writes them. For each shape, page size,
pipelined phase and variant: how many runs, the median and mean of the
runs' ratios (each run against the memcpys timed right before it), the
quartiles, the median share of the runs its daemon's event loop was busy
(where the files have it), and the median of each file (round) in round order. With
``--base LABEL``, each other variant's median minus the base's, and a 90%
bootstrap interval of that difference (each variant's runs resampled,
``BOOTSTRAP`` times, a fixed seed): an interval that spans 0 is no
difference. One call's runs swing with the machine (two identical variants
differed by 0.06 at 20 runs each); pooling rounds that alternate variants
in rotating order is how a difference of a few hundredths shows
(docs/benchmarks.md in git history).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

PHASES = ("store", "load", "both")
BOOTSTRAP = 2000


def variant_of(path: Path) -> str:
    return re.sub(r"-\d+$", "", path.stem)


def round_of(path: Path) -> int:
    m = re.search(r"-(\d+)$", path.stem)
    return int(m.group(1)) if m else 0


def pooled(paths: list[Path]) -> tuple[dict, set]:
    """(shape, page, phase, variant) -> [(round, [ratios of that file], [the daemon's loop
    busy share of each run, where the file has it])], and the GPUs."""
    runs, gpus = defaultdict(list), set()
    for path in sorted(paths, key=lambda p: (variant_of(p), round_of(p))):
        doc = json.loads(path.read_text())
        gpus.add(doc.get("gpu", "?"))
        for row in doc.get("pipelined", []):
            for phase in PHASES:
                ratios = row.get(f"{phase}_ratios")
                if ratios:
                    shape = row["shape"]  # with the pool where a file measured several
                    if len(doc.get("pools", [])) > 1 and row.get("pool"):
                        shape = f"{shape}/{row['pool']}"
                    key = (shape, row["page"], phase, variant_of(path))
                    runs[key].append((round_of(path), ratios,
                                      row.get(f"{phase}_loop_busy") or []))
    return runs, gpus


def summary(ratios: list[float]) -> str:
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return (f"n={len(ratios):<3} median {statistics.median(ratios):.2f}  mean "
            f"{statistics.mean(ratios):.2f}  quartiles {q[0]:.2f}-{q[2]:.2f}")


def difference(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Median of ``a`` minus median of ``b``, and the 5th and 95th percentiles of that
    difference over ``BOOTSTRAP`` resamplings of each list's runs."""
    rng, med = random.Random(seed), statistics.median
    diffs = sorted(med(rng.choices(a, k=len(a))) - med(rng.choices(b, k=len(b)))
                   for _ in range(BOOTSTRAP))
    return med(a) - med(b), diffs[BOOTSTRAP // 20], diffs[BOOTSTRAP - 1 - BOOTSTRAP // 20]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("paths", nargs="+", help="--json files of kvd bench --gpu, or directories")
    p.add_argument("--base", help="the variant the others are compared with")
    args = p.parse_args(argv)
    paths = []
    for arg in args.paths:
        path = Path(arg)
        paths.extend(sorted(path.glob("*.json")) if path.is_dir() else [path])
    if not paths:
        print("ratio_runs: no .json files in " + " ".join(args.paths), file=sys.stderr)
        return 2
    try:
        runs, gpus = pooled(paths)
    except (OSError, ValueError, KeyError) as exc:
        print(f"ratio_runs: {exc}", file=sys.stderr)
        return 1
    if not runs:
        print("ratio_runs: no pipelined runs in these files (run the bench with --pipeline N)",
              file=sys.stderr)
        return 1
    if args.base is not None and args.base not in {key[3] for key in runs}:
        print(f"ratio_runs: no variant {args.base!r} in these files", file=sys.stderr)
        return 2
    print(f"GPU: {', '.join(sorted(gpus))}; ratio = kvd GB/s / GB/s of the memcpys right "
          "before each run")
    order = sorted(runs, key=lambda k: (k[0], k[1], PHASES.index(k[2]), k[3]))
    for n, (shape, page, phase, variant) in enumerate(order):
        files = runs[(shape, page, phase, variant)]
        rounds = ", ".join(f"{statistics.median(r):.2f}" for _, r, _ in files)
        busy = [x for *_, b in files for x in b]
        loop = f"  loop busy {statistics.median(busy):.2f}" if busy else ""
        print(f"{shape:<13} {page:>4} {phase:<5} {variant:<12} {summary(every(files))}{loop}  "
              f"rounds: {rounds}")
        if n + 1 == len(order) or order[n + 1][:3] != (shape, page, phase):
            compare(runs, (shape, page, phase), args.base)
    return 0


def every(files: list) -> list[float]:
    return [x for _, ratios, _ in files for x in ratios]


def compare(runs: dict, where: tuple, base: str | None) -> None:
    """Each variant of ``where`` (shape, page, phase) against ``base``, if it ran there."""
    if base is None or (*where, base) not in runs:
        return
    ref = every(runs[(*where, base)])
    for key in sorted(k for k in runs if k[:3] == where and k[3] != base):
        d, lo, hi = difference(every(runs[key]), ref)
        print(f"{'':<24}{key[3]} - {base}: {d:+.2f} (90% interval {lo:+.2f} to {hi:+.2f})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
