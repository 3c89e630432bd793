"""examples/sglang_load.py without SGLang or a GPU: its table (each engine against the first) and
its report, which keeps the engines that ran."""

from __future__ import annotations

import json
import os
import re
import sys
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import sglang_load as L  # noqa: E402


def role(load_tps: float, decode_tps: float) -> dict:
    return {"load": {"tokens_per_s": load_tps, "ttft_p50": 0.120, "ttft_p99": 0.480},
            "decode": {"tokens_per_s": decode_tps}}


def test_each_engine_is_held_to_the_first_and_the_report_keeps_them(tmp_path, capsys):
    out = tmp_path / "load.json"
    rows = {"none": role(4000.0, 2000.0), "linker": role(3900.0, 2010.0)}
    L.report(Namespace(out=str(out)), rows)
    table = capsys.readouterr().out
    assert re.search(r"^ +none +4000 +1\.000 +120\.0ms +480\.0ms +2000 +1\.000$", table, re.M), table
    assert re.search(r"^ +linker +3900 +0\.975 +120\.0ms +480\.0ms +2010 +1\.005$", table, re.M), table
    saved = json.loads(out.read_text())
    assert saved["roles"]["linker"]["load"]["tokens_per_s"] == 3900.0
    assert saved["command"].startswith("python ")


def test_the_python_tree_engine_is_the_plain_engine_on_sglangs_python_radix_core(monkeypatch, tmp_path):
    """``none-pytree`` differs from ``none`` by the radix tree core alone, which ``linker`` runs too."""
    args = Namespace(model="m", prefix=64, unique=64, max_tokens=4, decode_tokens=4,
                     attention_backend="triton", cuda_graph=False, mem_fraction_static=0.8,
                     runtime_dir=str(tmp_path / "run"), extra="{}")
    assert L.engine_args(args, "none-pytree") == L.engine_args(args, "none")
    monkeypatch.delenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", raising=False)
    L.prepare(args, "none")
    assert "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND" not in os.environ
    for role in ("none-pytree", "linker"):
        monkeypatch.delenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", raising=False)
        L.prepare(args, role)
        assert os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "python"


def test_warm_up_and_timed_runs_take_prompts_of_their_own_the_same_in_every_engine():
    args = Namespace(prefix=128, unique=64, requests=3)
    load, short = L.workloads(args, "0")
    assert len(load) == len(short) == 3
    assert all(p[:128] == load[0][:128] and len(p) == 192 for p in load)   # one shared prefix
    assert len({tuple(p[128:]) for p in load}) == 3                         # each its own tail
    assert L.workloads(args, "0") == (load, short)                          # the same in every engine
    warm, _ = L.workloads(args, "warm-up/0")
    assert warm[0][:128] != load[0][:128]


def test_the_trace_counts_kvd_calls_inside_the_timed_load_runs_only(capsys, tmp_path):
    """Per op: calls and milliseconds per timed run (median of the runs), the longest call and its
    thread; calls outside every run (engine start, warm-up, decode runs) are not counted."""
    def line(op, t0, ms, thread="scheduler"):
        return {"op": op, "t0": t0, "t1": t0 + ms / 1e3, "thread": thread}
    lines = [line("offload", 1.0, 50.0),                                   # before the runs
             line("offload", 10.1, 2.0), line("offload", 10.2, 4.0), line("lookup", 10.3, 1.0),
             line("offload", 20.1, 3.0), line("poll_offloads", 20.2, 0.5, "pump"),
             line("offload", 30.1, 6.0), line("offload", 30.2, 1.0), line("offload", 30.3, 1.0)]
    got = L.trace_in_runs(lines, [[10.0, 11.0], [20.0, 21.0], [30.0, 31.0]])
    assert got["offload"] == {"calls": 2, "ms": 6.0, "max_ms": 6.0, "thread": "scheduler"}
    assert got["lookup"] == {"calls": 0, "ms": 0.0, "max_ms": 1.0, "thread": "scheduler"}
    assert got["poll_offloads"]["thread"] == "pump" and set(got) == {"offload", "lookup", "poll_offloads"}
    rows = {"linker": {**role(3900.0, 2010.0), "trace": got}}
    L.report(Namespace(out=str(tmp_path / "load.json")), rows)
    assert "[linker] kvd offload: 2 calls, 6.0 ms per load run (longest 6.0 ms, thread scheduler)" \
        in capsys.readouterr().out


def test_a_runs_lists_and_window_stay_out_of_its_medians():
    runs = [{"tokens_per_s": t, "ttfts_ms": [1.0, 2.0], "window": [0.0, 1.0]} for t in (1.0, 3.0, 2.0)]
    assert L.medians(runs) == {"tokens_per_s": 2.0}
