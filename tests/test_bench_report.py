"""kvd.bench.pipeline.report: the pipelined table as engines' users read it (no GPU);
and ``--json``, every run's figures in a file.

Rows as ``measure`` returns them: a phase that ran has its GB/s, its
memcpy baseline's GB/s, the median of the runs' ratios and each run's ratio;
a phase left out (``--pipeline-phases``) is NaN and has no runs. The table
prints each ratio as measured against its own baseline (not recomputed from
the medians) and the spread of the runs of every phase that ran.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvd.bench.common import write_json
from kvd.bench.pipeline import PHASES, report


def row(shape: str, **phases) -> dict:
    out = {"shape": shape, "page": 16, "bytes": 144 * 10**6, "clients": 2, "depth": 4}
    for phase in ("store", "load", "both"):
        kvd_gbps, memcpy_gbps, ratios = phases.get(phase, (float("nan"), float("nan"), None))
        out.update({f"{phase}_Bps": kvd_gbps * 1e9, f"{phase}_memcpy_Bps": memcpy_gbps * 1e9,
                    f"{phase}_ratio": float("nan") if ratios is None else sorted(ratios)[1]})
        if ratios is not None:
            out[f"{phase}_ratios"] = ratios
    return out


def test_each_ratio_is_the_median_of_the_runs_and_their_spread_is_shown(capsys):
    report([row("llama3-8b", store=(54.5, 55.1, [0.97, 0.99, 0.98]),
                load=(53.0, 53.5, [0.99, 1.00, 0.98]), both=(83.8, 85.5, [0.95, 0.98, 1.02])),
            {**row("deepseek-mla", both=(59.3, 86.5, [0.66, 0.78, 0.69])),
             "both_loop_busy": [0.71, 0.93, 0.85]}])
    out = capsys.readouterr().out
    lines = out.splitlines()
    llama = next(line for line in lines if line.startswith("llama3-8b"))
    assert llama.split() == ["llama3-8b", "16", "54.5", "0.98", "53.0", "0.99", "83.8", "0.98",
                             "55.1/53.5/85.5"]
    mla = lines[lines.index(next(line for line in lines if line.startswith("deepseek-mla"))) + 1]
    assert "both 0.66-0.78" in mla and "store" not in mla  # only the phase that ran
    assert "ratio of each run: store 0.97-0.99, load 0.98-1.00, both 0.95-1.02" in out
    assert "right before the run" in out
    busy = [line for line in lines if "event loop busy" in line]
    assert busy == [f"{'':<19}daemon's event loop busy (median of the runs): both 0.85"], busy


def test_no_rows_print_nothing(capsys):
    report([])
    assert capsys.readouterr().out == ""


def write_rows(path, monkeypatch, rows) -> None:
    monkeypatch.setattr(sys, "argv", ["kvd", "bench", "--gpu", "--pipeline", "4"])
    write_json(str(path), gpu="NVIDIA H100 80GB HBM3", blocking=[], pipelined=rows,
               gemm={"slowdown": np.float64(0.01)})


def test_json_keeps_every_runs_figures_and_the_command(tmp_path, monkeypatch):
    """``--json``: the command that ran, the GPU, and each row with every run's ratio and
    loop share, numpy numbers written as plain JSON numbers."""
    write_rows(tmp_path / "new-1.json", monkeypatch,
               [{**row("deepseek-mla", both=(70.0, 88.0, [np.float64(0.70), 0.80, 0.90])),
                 "both_loop_busy": [0.5, 0.6, 0.7]}])
    doc = json.loads((tmp_path / "new-1.json").read_text())
    assert doc["command"] == "kvd bench --gpu --pipeline 4" and doc["gemm"]["slowdown"] == 0.01
    assert doc["gpu"] == "NVIDIA H100 80GB HBM3"
    (got,) = doc["pipelined"]
    assert got["both_ratios"] == [0.70, 0.80, 0.90] and got["both_loop_busy"] == [0.5, 0.6, 0.7]


def test_json_is_refused_before_any_benchmark_runs(tmp_path):
    """A bad --json is an exit 2 with its reason at once (no GPU needed to find out)."""
    for extra, why in ((["--flood", "--json", str(tmp_path / "x.json")], "--json is for the host benchmark"),
                       (["--restart", "--json", str(tmp_path / "x.json")], "--json is for the host benchmark"),
                       (["--gpu", "--json", str(tmp_path / "no" / "x.json")], "no directory")):
        done = subprocess.run([sys.executable, "-m", "kvd", "bench", *extra],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and why in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())


def test_the_blocking_table_names_its_pools_and_page_order(capsys):
    from types import SimpleNamespace

    from kvd.bench.gpu import _report
    torch = SimpleNamespace(cuda=SimpleNamespace(get_device_name=lambda: "NVIDIA H100 80GB HBM3"))
    args = SimpleNamespace(chunk_tokens=256, chunks=8, gpu_pool="per-layer", page_order="sorted",
                           repeat=5)
    r = {"shape": "deepseek-mla", "page": 64, "bytes": 144 * 10**6, "store": 0.004, "load": 0.003,
         "both": 0.006, "memcpy_d2h": 0.0026, "memcpy_h2d": 0.0027, "memcpy_both": 0.0032}
    gemm = {"alone_ms": 1.46, "with_copies_ms": 1.50, "slowdown": 0.027, "copy_GBps": 35.0}
    _report(torch, [r], gemm, args)
    out = capsys.readouterr().out
    assert "per-layer pools, sorted page ids" in out
    assert "deepseek-mla     64    144     36.0   0.65    48.0   0.90    48.0   0.53" in out


def bench_args(*argv):
    import argparse

    from kvd.bench import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def fake_gpu_run(monkeypatch, tmp_path, *argv):
    """``kvd bench --gpu`` with its GPU work stubbed: which measurements it makes by default
    (no GPU needed), and what its report and --json say."""
    import types

    from kvd.bench import gpu, pipeline
    calls = []
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(init=lambda: None,
                                                             get_device_name=lambda: "test GPU"))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(gpu, "without_gpu_stack", lambda flag: False)
    monkeypatch.setattr(gpu, "start_daemon", lambda *a, **k: None)
    monkeypatch.setattr(gpu, "stop_daemon", lambda *a, **k: None)

    def blocking(torch, K, C, rundir, name, shape, page, args):
        calls.append(("blocking", args.gpu_pool, name, page))
        return {"shape": name, "page": page, "bytes": 10**8, "store": 0.004, "load": 0.004,
                "both": 0.006, "memcpy_d2h": 0.002, "memcpy_h2d": 0.002, "memcpy_both": 0.003}

    def piped(torch, K, C, make_pool, rundir, name, shape, page, args):
        calls.append(("pipelined", args.gpu_pool, name, page, args.pipeline))
        return {"shape": name, "page": page, "bytes": 10**8, "clients": 2, "depth": args.pipeline,
                **{f"{p}_{k}": 0.9 if k == "ratio" else 5e10 for p in PHASES
                   for k in ("Bps", "memcpy_Bps", "ratio")}}

    def gemm(torch, K, C, rundir, args):
        calls.append(("gemm", args.gpu_pool))
        return {"alone_ms": 1.5, "with_copies_ms": 1.6, "slowdown": 0.06, "copy_GBps": 10.0}

    monkeypatch.setattr(gpu, "_measure_shape", blocking)
    monkeypatch.setattr(pipeline, "measure", piped)
    monkeypatch.setattr(gpu, "_gemm_slowdown", gemm)
    monkeypatch.setattr(sys, "argv", ["kvd", "bench", "--gpu", *argv])
    args = bench_args("--gpu", *argv)
    assert gpu.run(args) == 0
    return calls


def test_bench_gpu_defaults_to_what_engines_do(monkeypatch, tmp_path, capsys):
    """Requests in flight on the pools vLLM and SGLang allocate; no blocking figures unless
    asked for."""
    out = tmp_path / "gpu.json"
    calls = fake_gpu_run(monkeypatch, tmp_path, "--gpu-page-sizes", "16", "--json", str(out))
    assert calls == [("pipelined", pool, shape, 16, 4) for pool in ("one", "per-layer")
                     for shape in ("llama3-8b", "deepseek-mla")]
    text = capsys.readouterr().out
    assert "pipelined: 2 engines x 4 requests in flight" in text and "blocking" not in text
    assert "one pools (all layers in one allocation, as vLLM's)" in text
    assert "per-layer pools (each layer its own allocation, as SGLang's)" in text
    doc = json.loads(out.read_text())
    assert doc["pools"] == ["one", "per-layer"] and doc["blocking"] == [] and doc["gemm"] is None
    assert [r["pool"] for r in doc["pipelined"]] == ["one", "one", "per-layer", "per-layer"]


def test_bench_gpu_blocking_figures_only_when_asked(monkeypatch, tmp_path, capsys):
    calls = fake_gpu_run(monkeypatch, tmp_path, "--gpu-page-sizes", "16", "--gpu-shapes", "llama3-8b",
                         "--gpu-pool", "per-layer", "--blocking")
    assert calls == [("blocking", "per-layer", "llama3-8b", 16),
                     ("pipelined", "per-layer", "llama3-8b", 16, 4), ("gemm", "per-layer")]
    text = capsys.readouterr().out
    assert "blocking, one request at a time" in text and "per-layer pools, random page ids" in text
    calls = fake_gpu_run(monkeypatch, tmp_path, "--gpu-page-sizes", "16", "--gpu-shapes", "llama3-8b",
                         "--pipeline", "0")
    assert calls == [("blocking", "one", "llama3-8b", 16), ("blocking", "per-layer", "llama3-8b", 16),
                     ("gemm", "one")]


def test_bench_gpu_refuses_an_unknown_pool_kind():
    with pytest.raises(SystemExit):
        bench_args("--gpu", "--gpu-pool", "one,two")
    assert bench_args("--gpu", "--gpu-pool", "block-outer").gpu_pool == ["block-outer"]
