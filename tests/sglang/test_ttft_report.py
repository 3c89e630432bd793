"""examples/sglang_ttft.py without SGLang or a GPU: its table (the bound, suffix + floor, and each
kvd hit against it, from rows as the roles return them) and the linker engine's settings."""

from __future__ import annotations

import json
import re
import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import sglang_ttft as T  # noqa: E402


def rows() -> dict:
    # seconds per repeat, as the roles write them; 8k has no floor (an engine that ran without one)
    return {2048: {"full": [0.066, 0.070, 0.060], "suffix": [0.040, 0.041, 0.042], "floor": [0.004],
                   "kvd/radix": [0.050, 0.048, 0.052], "daemon_load/radix": [0.005, 0.005, 0.006],
                   "storage_hit_tokens/radix": [2048, 2048, 2048]},
            8192: {"full": [0.294], "suffix": [0.040], "kvd/radix": [0.100],
                   "daemon_load/radix": [0.02], "storage_hit_tokens/radix": [8192]}}


def test_the_bound_is_the_suffix_plus_the_floor_and_each_hit_is_held_to_it(tmp_path, capsys):
    out = tmp_path / "ttft.json"
    args = Namespace(pool_list=["radix"], host_hit=False, trace=False, out=str(out))
    T.report(args, rows())
    lines = {int(m[1]): m[0] for m in re.finditer(r"^ +(\d+) +radix .*$", capsys.readouterr().out, re.M)}
    # 2k: bound 41 + 4 = 45 ms, kvd 50 ms: 1.11x; speedup 66 / 50 = 1.3x
    assert re.search(r"41\.0 +45\.0 +50\.0 +5\.0 +2048 +1\.11x +1\.3x$", lines[2048]), lines[2048]
    # 8k: no floor, no bound: the ratio is left out, never made up
    assert re.search(r"40\.0 +- +100\.0 +20\.0 +8192 +- +2\.9x$", lines[8192]), lines[8192]
    saved = json.loads(out.read_text())
    assert saved["median"]["2048"]["bound"] == pytest.approx(0.045)
    assert "bound" not in saved["median"]["8192"]
    assert saved["command"].startswith("python ")


def test_the_linker_engine_loads_through_sglangs_linker_and_nothing_of_hicache():
    args = Namespace(prefix_list=[2048], suffix=256, model="m", attention_backend="triton",
                     mem_fraction_static=0.85, trace=False, sglang_times=False, runtime_dir="/run/kvd",
                     extra='{"kvd_timeout_s": 5}')
    kw = T.engine_args(args, "kvd-linker@0.2")
    assert kw["enable_unified_cache_external_linker"] is True
    assert kw["unified_cache_external_linker_config"] == {
        "linker": "KvdLinker", "linker_module_path": "kvd_client.sglang.linker",
        "linker_extra_config": {"kvd_runtime_dir": "/run/kvd", "kvd_timeout_s": 5, "kvd_gil_switch_ms": 0.2}}
    assert "enable_hierarchical_cache" not in kw and "radix_cache_backend" not in kw


def test_kvd_engines_ask_sglang_for_its_python_radix_core(monkeypatch):
    """kvd's token keys learn token ids from SGLang's Python hashing (docs/sglang.md)."""
    monkeypatch.delenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", raising=False)
    T.python_radix_core()
    import os
    assert os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "python"
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "rust")  # a user's choice stands
    T.python_radix_core()
    assert os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "rust"


def report_args(tmp_path, name: str, pools: list, **kw) -> Namespace:
    return Namespace(pool_list=pools, host_hit=False, trace=False, out=str(tmp_path / name), layers=32,
                     suffix=256, attention_backend="triton", merge=tmp_path / "first.json", **kw)


def test_a_run_split_over_calls_reports_both_halves_against_one_bound(tmp_path, capsys):
    first = {n: {k: v for k, v in r.items() if "/" in k} for n, r in rows().items()}  # the kvd engine
    second = {n: {k: v for k, v in r.items() if "/" not in k} for n, r in rows().items()}  # full, suffix
    second[2048].update(host=[0.047], host_hit_tokens=[2048])
    T.save(report_args(tmp_path, "first.json", ["radix"]), first)
    args = report_args(tmp_path, "both.json", [])
    earlier = T.read_earlier(args)
    both = T.merged(earlier, second)
    args.pool_list += earlier["args"]["pool_list"]
    T.report(args, both, earlier)
    out = capsys.readouterr().out
    row = r"^ +2048 +radix +66\.0 +41\.0 +45\.0 +50\.0 +5\.0 +2048 +1\.11x +1\.3x$"  # both halves
    assert re.search(row, out, re.M), out
    assert re.search(r"^ +2048 +47\.0 +2048 +1\.06$", out, re.M), out  # kvd / SGLang's host-tier hit
    saved = json.loads((tmp_path / "both.json").read_text())
    assert saved["runs"]["2048"]["kvd/radix"] == rows()[2048]["kvd/radix"]
    assert saved["runs"]["2048"]["full"] == rows()[2048]["full"]
    assert saved["command"].count("python ") == 2 and "; then " in saved["command"]


def test_a_merge_of_figures_measured_otherwise_is_refused_before_any_engine(tmp_path):
    T.save(report_args(tmp_path, "first.json", ["linker"]), rows())
    for change in ({"layers": 16}, {"suffix": 128}, {"attention_backend": "fa3"}):
        args = report_args(tmp_path, "x.json", [])
        vars(args).update(change)
        with pytest.raises(SystemExit, match=f"measured otherwise: {next(iter(change))}"):
            T.read_earlier(args)
    (tmp_path / "first.json").write_text("{}")
    with pytest.raises(SystemExit, match="not a report of this script"):
        T.read_earlier(report_args(tmp_path, "x.json", []))
