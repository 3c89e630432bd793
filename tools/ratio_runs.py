#!/usr/bin/env python3
"""Every run's ratio to memcpy, pooled over several `kvd bench --gpu --json` files.

    python3 tools/ratio_runs.py OUT/new-1.json OUT/new-2.json OUT/off-1.json ...
    python3 tools/ratio_runs.py OUT              (every *.json in OUT)

A file's variant is its name less a trailing ``-<round>`` (``new-3.json``:
``new``), as tools/ab_runs.sh writes them. For each shape, page size,
pipelined phase and variant: how many runs, the median and mean of the
runs' ratios (each run against the memcpys timed right before it), the
quartiles, and the median of each file (round) in round order. One call's
runs swing with the machine; pooling rounds that alternate variants is how
a difference of a few hundredths shows (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

PHASES = ("store", "load", "both")


def variant_of(path: Path) -> str:
    return re.sub(r"-\d+$", "", path.stem)


def round_of(path: Path) -> int:
    m = re.search(r"-(\d+)$", path.stem)
    return int(m.group(1)) if m else 0


def pooled(paths: list[Path]) -> tuple[dict, set]:
    """(shape, page, phase, variant) -> [(round, [ratios of that file])], and the GPUs."""
    runs, gpus = defaultdict(list), set()
    for path in sorted(paths, key=lambda p: (variant_of(p), round_of(p))):
        doc = json.loads(path.read_text())
        gpus.add(doc.get("gpu", "?"))
        for row in doc.get("pipelined", []):
            for phase in PHASES:
                ratios = row.get(f"{phase}_ratios")
                if ratios:
                    key = (row["shape"], row["page"], phase, variant_of(path))
                    runs[key].append((round_of(path), ratios))
    return runs, gpus


def summary(ratios: list[float]) -> str:
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return (f"n={len(ratios):<3} median {statistics.median(ratios):.2f}  mean "
            f"{statistics.mean(ratios):.2f}  quartiles {q[0]:.2f}-{q[2]:.2f}")


def main(argv: list[str]) -> int:
    paths = []
    for arg in argv:
        p = Path(arg)
        paths.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    if not paths:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: ratio_runs.py FILE.json... | DIR", file=sys.stderr)
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
    print(f"GPU: {', '.join(sorted(gpus))}; ratio = kvd GB/s / GB/s of the memcpys right "
          "before each run")
    for (shape, page, phase, variant), files in sorted(runs.items(),
                                                       key=lambda kv: (kv[0][0], kv[0][1],
                                                                       PHASES.index(kv[0][2]),
                                                                       kv[0][3])):
        every = [x for _, ratios in files for x in ratios]
        rounds = ", ".join(f"{statistics.median(r):.2f}" for _, r in files)
        print(f"{shape:<13} {page:>4} {phase:<5} {variant:<12} {summary(every)}  rounds: {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
