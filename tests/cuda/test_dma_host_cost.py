"""tools/dma_host_cost.py runs as documented and times each path it names.

It drives the real ``DmaPath`` (CUDA stubbed): every row must say the copy
went the way its column asks (straight rows ``DMA``, staged rows ``staged
DMA``), for both shapes and directions, with a positive time.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dma_host_cost_times_both_paths():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "dma_host_cost.py"), "--repeat", "3", "--chunks", "2",
         "--page-sizes", "16"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout
    rows = [re.match(r"(\S+)\s+16\s+(DMA|staged DMA)\s+(store|load)\s+(\d+)", line)
            for line in out.splitlines()[1:]]
    assert all(rows) and len(rows) == 8, out
    assert [r[2] for r in rows] == ["DMA", "DMA", "staged DMA", "staged DMA"] * 2, out
    assert {r[1] for r in rows} == {"llama3-8b", "deepseek-mla"}
    assert all(int(r[4]) > 0 for r in rows)


def test_dma_host_cost_per_pool_kind_and_knobs():
    """--pool picks the pool's allocation: block-outer pages (one group of every plane)
    may be staged, per-layer pages (each plane its own group) never are; the knob flags
    take sizes as the config does, and a bad one is a usage error."""
    for pool, staged in (("block-outer", "staged DMA"), ("per-layer", "DMA")):
        out = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "dma_host_cost.py"), "--repeat", "3",
             "--chunks", "2", "--page-sizes", "16", "--pool", pool, "--streams", "2",
             "--spread-below", "64KiB", "--load-window", "1GiB"],
            capture_output=True, text=True, timeout=120, cwd=ROOT, check=True).stdout
        rows = [re.match(r"(\S+)\s+16\s+(DMA|staged DMA)\s+(store|load)\s+(\d+)", line)
                for line in out.splitlines()[1:]]
        assert all(rows) and len(rows) == 8, out
        assert [r[2] for r in rows] == ["DMA", "DMA", staged, staged] * 2, out
        assert all(int(r[4]) > 0 for r in rows)
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "dma_host_cost.py"),
                          "--load-window", "lots"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert bad.returncode == 2 and "--load-window" in bad.stderr
