"""The docs' figures have one source: the benchmark JSON in docs/data/.

README.md, docs/vllm.md, docs/gpu.md, docs/performance.md and docs/fleet.md quote the same
tables, rendered by tools/plot_docs.py between ``<!-- table: NAME -->``
markers. A table edited by hand, or a JSON file replaced without
re-rendering, fails here.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "plot_docs.py"
QUOTED = {"README.md": {"summary"}, "docs/vllm.md": {"vllm_ttft", "vllm_load"},
          "docs/gpu.md": {"gpu_copy"}, "docs/performance.md": {"vllm_ttft", "vllm_load", "gpu_copy"},
          "docs/sglang.md": {"sglang_ttft", "sglang_linker", "sglang_breakdown", "sglang_load"}, "docs/restart.md": {"host_verify"},
          "docs/fleet.md": {"fleet"}}
QUOTED["docs/performance.md"] = QUOTED["docs/performance.md"] | {"host_bench"}  # same JSON as host_verify


def check(root: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *flags, "--root", str(root)], capture_output=True,
                          text=True, timeout=60)


def copy_docs(tmp: Path) -> Path:
    shutil.copy(ROOT / "README.md", tmp / "README.md")
    shutil.copytree(ROOT / "docs", tmp / "docs", ignore=shutil.ignore_patterns("img"))
    return tmp


def test_every_docs_table_matches_its_json():
    proc = check(ROOT, "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_pages_quote_the_figures_from_the_data():
    for page, names in QUOTED.items():
        text = (ROOT / page).read_text()
        for name in names:
            assert f"<!-- table: {name} -->" in text, f"{page} lost its {name} table"


def test_a_table_edited_by_hand_fails_the_check_and_write_restores_it(tmp_path):
    root = copy_docs(tmp_path)
    vllm = root / "docs" / "vllm.md"
    text = vllm.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 32k | "))
    cells = row.split(" | ")
    cells[2] = "1.0 ms"  # the kvd hit's cell, by hand
    vllm.write_text(text.replace(row, " | ".join(cells)))
    proc = check(root, "--check")
    assert proc.returncode == 1
    assert "docs/vllm.md: table vllm_ttft differs" in proc.stdout
    assert "performance.md" not in proc.stdout  # the other copies still agree with the data
    assert check(root, "--write").returncode == 0
    assert vllm.read_text() == text and check(root, "--check").returncode == 0


def test_new_data_without_rendering_fails_every_page_that_quotes_it(tmp_path):
    root = copy_docs(tmp_path)
    path = root / "docs" / "data" / "vllm_ttft_h200.json"
    doc = json.loads(path.read_text())
    doc["runs"]["32768"]["full"] = [v * 2 for v in doc["runs"]["32768"]["full"]]
    path.write_text(json.dumps(doc))
    proc = check(root, "--check")
    assert proc.returncode == 1
    for page in ("README.md: table summary", "docs/vllm.md: table vllm_ttft",
                 "docs/performance.md: table vllm_ttft"):
        assert page in proc.stdout, proc.stdout
    assert check(root, "--write").returncode == 0
    doubled = statistics.median(doc["runs"]["32768"]["full"])
    assert f"| 32k | {doubled * 1e3:.1f} ms |" in (root / "docs" / "vllm.md").read_text()
    assert check(root, "--check").returncode == 0


def test_an_unknown_table_name_is_an_error(tmp_path):
    root = copy_docs(tmp_path)
    (root / "docs" / "extra.md").write_text("<!-- table: nosuch -->\n<!-- /table -->\n")
    proc = check(root, "--check")
    assert proc.returncode == 1 and "unknown table 'nosuch'" in proc.stdout


def test_a_new_gpu_bench_json_replaces_a_copy_table(tmp_path, monkeypatch):
    """What ``kvd bench --gpu --json`` writes (its own writer, rows as kvd.bench.pipeline
    makes them) is what the copy tables render: a re-run updates every page quoting it."""
    from kvd.bench.common import write_json
    root = copy_docs(tmp_path)
    data = root / "docs" / "data"
    old = json.loads((data / "gpu_copy_h100_one.json").read_text())
    rows = [{**r, "store_ratio": 0.5, "load_ratio": 0.6, "both_ratio": 0.7,
             "store_ratios": [0.5], "bytes": 1, "store_Bps": 1.0}
            for r in old["pipelined"]]
    monkeypatch.setattr(sys, "argv", ["kvd", "bench", "--gpu", "--gpu-pool", "one", "--json", "x.json"])
    write_json(str(data / "gpu_copy_h100_one.json"), gpu="NVIDIA H100 80GB HBM3", pools=["one"],
               page_order="random", repeat=5, chunk_tokens=256, chunks=8, blocking=[],
               pipelined=rows, gemm=None)
    assert check(root, "--check").returncode == 1
    assert check(root, "--write").returncode == 0, "render failed"
    perf = (root / "docs" / "performance.md").read_text()
    assert "| 0.50 | 0.60 | 0.70 |" in perf and "kvd bench --gpu --gpu-pool one --json x.json" in perf
    assert check(root, "--check").returncode == 0


def test_a_fleet_run_renders_its_tables(tmp_path):
    """A fleet report (examples/fleet.py --out) renders its steady pass, restart rows and the
    ratios the targets name; a second run (another GPU) adds its own block."""
    root = copy_docs(tmp_path)
    data = root / "docs" / "data"
    doc = json.loads(next(data.glob("fleet_*.json")).read_text())
    for arm in doc["arms"].values():
        for p in arm.get("passes", {}).values():
            p["summary"]["ttft_p50"] = 1234.5
    doc["gpu"] = "NVIDIA H200"
    (data / "fleet_zz_h200.json").write_text(json.dumps(doc))
    assert check(root, "--check").returncode == 1
    assert check(root, "--write").returncode == 0
    page = (root / "docs" / "fleet.md").read_text()
    assert "**NVIDIA H200**" in page and "| 1234.5 |" in page and "**CPU**" in page
    assert check(root, "--check").returncode == 0
