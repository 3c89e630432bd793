"""Plots of measured tables: ``kvd bench --plot``, the TTFT chart, docs/img.

Real benchmark runs (small) draw real PNGs; the docs' pictures are drawn
from docs/data/ and from the tables of docs/performance.md, which must keep
parsing (tools/plot_docs.py --images).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

image = pytest.importorskip("matplotlib.image")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import plot_docs  # noqa: E402


def png_shape(path: Path) -> tuple:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return image.imread(path).shape


def test_bench_plot_draws_the_run_it_measured(tmp_path):
    out = tmp_path / "host.png"
    proc = subprocess.run([sys.executable, "-m", "kvd", "bench", "--layers", "2", "--kv-heads", "2",
                           "--head-dim", "64", "--chunks", "2", "--repeat", "1", "--plot", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"plot: {out}" in proc.stdout
    assert png_shape(out)[:2] == (480, 900)


def test_disk_bench_plot(tmp_path):
    out = tmp_path / "disk.png"
    proc = subprocess.run([sys.executable, "-m", "kvd", "bench", "--disk", "--disk-dir", str(tmp_path),
                           "--disk-gib", "0.03", "--disk-chunk", "1MiB", "--disk-threads", "2",
                           "--repeat", "1", "--plot", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert png_shape(out)[:2] == (480, 900)


def test_without_matplotlib_plot_fails_before_benchmarking(tmp_path):
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden')\n")
    proc = subprocess.run([sys.executable, "-m", "kvd", "bench", "--plot", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "pip install matplotlib" in proc.stdout
    assert "run 0" not in proc.stdout  # nothing was measured


def test_prefix_reuse_replots_a_saved_result(tmp_path):
    # the shape of examples/prefix_reuse.py's --out record (as `assemble` writes it)
    row = {"prompt": "2048", "prefix": 2048, "suffix": 256, "corrupt": False, "full_ms": 17.3,
           "suffix_ms": 11.7, "floor_ms": 1.3, "bound": 1.3, "kvd_ms": 12.5, "speedup": 1.4,
           "of_bound": 1.04, "load_hidden": 0.37, "logits": {"ok": True, "argmax_same": True, "rel": 0.015}}
    result = {"command": "examples/prefix_reuse.py", "model": {"num_hidden_layers": 8, "hidden_size": 4096,
              "num_key_value_heads": 8}, "page_size": 16, "chunk_tokens": 256, "suffix": 256,
              "repeat": 3, "rtol": 0.02, "gpu": "test GPU", "torch": "x", "transformers": "y",
              "rows": [row, {**row, "prompt": "2048 corrupt", "corrupt": True,
                             "logits": {"ok": False, "argmax_same": False, "rel": 1.3}}],
              "clean_ok": True, "corrupt_caught": True}
    (tmp_path / "r.json").write_text(json.dumps(result))
    out = tmp_path / "ttft.png"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "prefix_reuse.py"), "--replot",
                           str(tmp_path / "r.json"), "--plot", str(out)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "17.3" in proc.stdout and png_shape(out)[:2] == (480, 900)


def test_docs_images_are_drawn_from_the_data_and_the_performance_tables(tmp_path):
    doc = (ROOT / "docs" / "performance.md").read_text()
    ttft = plot_docs.md_table(doc, "## Prefix reuse with transformers")
    assert [r["prefix"] for r in ttft][:3] == ["2048", "8192", "32768"] and "kvd ms" in ttft[0]
    disk = plot_docs.md_table(doc, "## Disk tier")
    assert {"tier/raw", "tier/raw #2"} <= set(disk[0])  # write and read ratios, both kept
    assert plot_docs.main(["--images", str(tmp_path)]) == 0
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn == sorted(p.name for p in (ROOT / "docs" / "img").glob("*.png"))
    for name in drawn:
        assert png_shape(tmp_path / name)[:2] == (480, 900)


def test_the_fleet_page_splits_the_time_to_first_token_where_a_run_kept_it():
    import plot_fleet  # noqa: PLC0415  (tools/, on the path above)

    doc = json.loads((ROOT / "docs" / "data" / "fleet_h200.json").read_text())
    assert "engine TTFT mean ms" not in plot_fleet.render_fleet([doc])  # kept no split: no table
    steady = doc["arms"]["kvd"]["passes"]["steady"]
    steady["engine_times"] = {"ttft_mean_ms": 45.5, "queue_mean_ms": 3.5, "prefill_mean_ms": 41.0}
    steady["daemon"] = {"latency": {"lookup": {"p50_ms": 0.125}, "load": {"p50_ms": 1.5}}}
    block = plot_fleet.render_fleet([doc])
    assert "| kvd, one daemon for all servers | 45.5 | 3.5 | 41.0 | 0.12 | 1.50 | – |" in block, block
    steady["daemon"]["phases"] = {"load": {"turn": {"p50_ms": 0.25}, "engine": {"p50_ms": 1.0},
                                           "copy": {"p50_ms": 0.5}}}
    block = plot_fleet.render_fleet([doc])
    assert "| 0.12 | 1.50 | 0.25 / 1.00 / 0.50 |" in block, block


def test_a_fleet_image_is_named_for_the_gpu_model_not_its_memory():
    import plot_fleet  # noqa: PLC0415  (tools/, on the path above)

    assert plot_fleet.image_name({"gpu": "NVIDIA H100 80GB HBM3"}) == "fleet_h100.png"
    assert plot_fleet.image_name({"gpu": "NVIDIA H200"}) == "fleet_h200.png"
    assert plot_fleet.image_name({"gpu": "CPU"}) == "fleet_cpu.png"
    assert plot_fleet.image_name({"gpu": "CPU", "workload": {"kind": "multi_turn"}}) == "fleet_cpu_multi_turn.png"


def test_the_multi_turn_table_shows_each_turn_and_the_history_recomputed():
    import plot_fleet  # noqa: PLC0415  (tools/, on the path above)

    args = {"conversations": "2", "turns": "2", "prefix_len": "10", "suffix_len": "2", "output_len": "1"}
    # new prompt tokens: 2 x (10 + 2) first turns + 2 x (1 + 2) second ones = 30; 4 more computed
    steady = {"ttft_p50_by_turn": [1.0, 2.5], "hits": {"gpu": 0, "external": 20, "computed": 34}}
    doc = {"args": args, "workload": {"kind": "multi_turn", "prompts": 4, "new_prompt_tokens": 30},
           "arms": {"kvd": {"passes": {"steady": steady}}, "none": {"passes": {}}}}
    assert plot_fleet.turn_rows(doc) == [["kvd, one daemon for all servers", "1.0", "2.5", "2"]]
    # request 3 (conversation 1's second turn) failed: its 3 new tokens and its turn do not count
    steady.update(failed_requests=[3], hits={"gpu": 0, "external": 10, "computed": 31})
    assert plot_fleet.turn_rows(doc) == [["kvd, one daemon for all servers", "1.0", "2.5", "4"]]
    # a report from before failed requests were listed: they are the ones that generated nothing
    del steady["failed_requests"]
    steady["text_hashes"] = ["a", "b", "c", plot_fleet.NO_TEXT]
    assert plot_fleet.turn_rows(doc)[0][3] == "4"
