"""Lay out the GPU runs that carry the staged SGLang (tools/gpu/stage_sglang.sh).

    python3 tools/gpu/carry_sglang.py [--budget BYTES]     # default 60 MiB a run

Reads ``.sgstage/parts/``: whole archives ``part?.tar.xz`` and pieces of split
ones ``part?.tar.xz.KofN``. Fills runs in order (pieces first, part A last),
each at most ``--budget`` bytes, into ``.sgstage/cur1``, ``cur2``, ...: hard
links of the parts, ``call1.sh`` (unpack) in each and ``call2.sh`` (unpack,
check, run) in the last. Prints every size and, for each run, its ``carry``
list and command. A part over the budget is an error: split it when staging.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

STAGE = Path(".sgstage")
HERE = Path(__file__).resolve().parent


def order(parts: list[Path]) -> list[Path]:
    """Pieces first, then whole parts from the last letter back: part A (SGLang) last."""
    pieces = sorted(p for p in parts if not p.name.endswith(".tar.xz"))
    return pieces + sorted((p for p in parts if p.name.endswith(".tar.xz")), reverse=True)


def pack(parts: list[Path], budget: int) -> list[list[Path]]:
    runs: list[list[Path]] = [[]]
    for p in order(parts):
        size = p.stat().st_size
        if size > budget:
            raise SystemExit(f"{p.name} is {size} bytes, over the {budget} one run carries: split it")
        if sum(q.stat().st_size for q in runs[-1]) + size > budget:
            runs.append([])
        runs[-1].append(p)
    return runs


def lay_out(runs: list[list[Path]]) -> None:
    for old in STAGE.glob("cur*"):
        shutil.rmtree(old)
    for i, run in enumerate(runs, 1):
        cur = STAGE / f"cur{i}"
        cur.mkdir()
        for p in run:
            os.link(p, cur / p.name)
        shutil.copy(HERE / "sglang_call1.sh", cur / "call1.sh")
        if i == len(runs):
            shutil.copy(HERE / "sglang_call2.sh", cur / "call2.sh")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=60 << 20)
    a = ap.parse_args()
    os.chdir(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                            check=True).stdout.strip())
    parts = sorted((STAGE / "parts").glob("part*.tar.xz*"))
    runs = pack(parts, a.budget)
    lay_out(runs)
    tracked = subprocess.run("git ls-files -z | xargs -0 du -cb | tail -1", shell=True, capture_output=True,
                             text=True).stdout.split()[0]
    for p in parts:
        print(f"{p.name:24s} {p.stat().st_size:>11,d} bytes  {p.stat().st_size / 2**20:6.1f} MiB")
    print(f"tracked tree {int(tracked):,d} bytes; {len(runs)} run(s), back to back:")
    for i, run in enumerate(runs, 1):
        size = sum(p.stat().st_size for p in run)
        cmd = "call2.sh COMMAND..." if i == len(runs) else "call1.sh"
        print(f"  {i}. carry [\"{STAGE}/cur{i}\"] ({size / 2**20:.1f} MiB): bash {STAGE}/cur{i}/{cmd}")


if __name__ == "__main__":
    main()
