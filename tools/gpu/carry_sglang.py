"""Lay out the GPU runs that carry the staged SGLang (tools/gpu/stage_sglang.sh).

    python3 tools/gpu/carry_sglang.py [--budget BYTES]     # default 60 MiB a run
    python3 tools/gpu/carry_sglang.py --stage .sg023stage --site /tmp/sg023site

Reads ``STAGE/parts/`` (``--stage``, default ``.sgstage``): whole archives
``part?.tar.xz`` and pieces of split ones ``part?.tar.xz.KofN``. Fills runs in
order (pieces first, part A last), each at most ``--budget`` bytes, into
``STAGE/cur1``, ``cur2``, ...: hard links of the parts, ``call1.sh`` (unpack)
in each and ``call2.sh`` (unpack, check, run) in the last, and ``stage.env``
naming the GPU machine's directory they unpack into (``--site``). Prints every
size and, for each run, its ``carry`` list and command. A part over the budget
is an error: split it when staging.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

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


def lay_out(stage: Path, runs: list[list[Path]], site: str) -> None:
    for old in stage.glob("cur*"):
        shutil.rmtree(old)
    for i, run in enumerate(runs, 1):
        cur = stage / f"cur{i}"
        cur.mkdir()
        for p in run:
            os.link(p, cur / p.name)
        shutil.copy(HERE / "sglang_call1.sh", cur / "call1.sh")
        (cur / "stage.env").write_text(f"SGSITE={site}\n")  # where call1.sh and call2.sh unpack
        if i == len(runs):
            shutil.copy(HERE / "sglang_call2.sh", cur / "call2.sh")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=60 << 20)
    ap.add_argument("--stage", type=Path, default=Path(".sgstage"), help="the staging directory")
    ap.add_argument("--site", default="/tmp/sgsite", help="where the GPU machine unpacks its parts")
    a = ap.parse_args()
    stage = a.stage
    os.chdir(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                            check=True).stdout.strip())
    parts = sorted((stage / "parts").glob("part*.tar.xz*"))
    runs = pack(parts, a.budget)
    lay_out(stage, runs, a.site)
    tracked = subprocess.run("git ls-files -z | xargs -0 du -cb | tail -1", shell=True, capture_output=True,
                             text=True).stdout.split()[0]
    for p in parts:
        print(f"{p.name:24s} {p.stat().st_size:>11,d} bytes  {p.stat().st_size / 2**20:6.1f} MiB")
    print(f"tracked tree {int(tracked):,d} bytes; {len(runs)} run(s), back to back:")
    for i, run in enumerate(runs, 1):
        size = sum(p.stat().st_size for p in run)
        cmd = "call2.sh COMMAND..." if i == len(runs) else "call1.sh"
        print(f"  {i}. carry [\"{stage}/cur{i}\"] ({size / 2**20:.1f} MiB): bash {stage}/cur{i}/{cmd}")


if __name__ == "__main__":
    main()
