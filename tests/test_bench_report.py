"""kvd.bench.pipeline.report: the pipelined table as engines' users read it (no GPU);
``--json`` and tools/ratio_runs.py, which pools every run's ratio over rounds.

Rows as ``measure`` returns them: a phase that ran has its GB/s, its
memcpy baseline's GB/s, the median of the runs' ratios and each run's ratio;
a phase left out (``--pipeline-phases``) is NaN and has no runs. The table
prints each ratio as measured against its own baseline (not recomputed from
the medians) and the spread of the runs of every phase that ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvd.bench.common import write_json
from kvd.bench.pipeline import PHASES, report

TOOLS = Path(__file__).resolve().parent.parent / "tools"


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


def test_json_rows_pool_into_each_variants_runs(tmp_path, monkeypatch):
    """``--json`` files of alternating rounds (tools/ab_runs.sh names them label-round):
    tools/ratio_runs.py pools each variant's runs, in round order, numpy numbers and all."""
    write_rows(tmp_path / "new-1.json", monkeypatch,
               [{**row("deepseek-mla", both=(70.0, 88.0, [np.float64(0.70), 0.80, 0.90])),
                 "both_loop_busy": [0.5, 0.6, 0.7]}])
    write_rows(tmp_path / "new-2.json", monkeypatch,
               [{**row("deepseek-mla", both=(70.0, 88.0, [0.60, 0.75, 1.00])),
                 "both_loop_busy": [0.8, 0.9, 0.4]}])
    write_rows(tmp_path / "off-1.json", monkeypatch,
               [row("deepseek-mla", both=(80.0, 88.0, [0.85, 0.90, 0.95]),
                    store=(50.0, 55.0, [0.95, 0.96, 0.97]))])
    doc = json.loads((tmp_path / "new-1.json").read_text())
    assert doc["command"] == "kvd bench --gpu --pipeline 4" and doc["gemm"]["slowdown"] == 0.01
    out = subprocess.run([sys.executable, str(TOOLS / "ratio_runs.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    lines = {tuple(line.split()[:4]): line for line in out.splitlines()[1:]}
    assert set(lines) == {("deepseek-mla", "16", "both", "new"), ("deepseek-mla", "16", "both", "off"),
                          ("deepseek-mla", "16", "store", "off")}
    new = lines[("deepseek-mla", "16", "both", "new")]
    assert "n=6" in new and "median 0.78" in new and "mean 0.79" in new
    assert new.endswith("rounds: 0.80, 0.75")
    assert "loop busy 0.65" in new  # the median of the six runs' shares
    assert "median 0.90" in lines[("deepseek-mla", "16", "both", "off")]
    assert "loop busy" not in lines[("deepseek-mla", "16", "both", "off")]  # older files
    assert "NVIDIA H100" in out.splitlines()[0]
    out = subprocess.run([sys.executable, str(TOOLS / "ratio_runs.py"), str(tmp_path),
                          "--base", "off"], capture_output=True, text=True, check=True).stdout
    (diff,) = [line.split() for line in out.splitlines() if "new - off" in line]
    assert diff[3] == "-0.12"  # medians 0.78 and 0.90; store ran for off only: no line
    lo, hi = float(diff[6]), float(diff[8].rstrip(")"))
    assert lo <= -0.12 <= hi and lo < hi < 0.1
    done = subprocess.run([sys.executable, str(TOOLS / "ratio_runs.py"), str(tmp_path),
                           "--base", "nope"], capture_output=True, text=True)
    assert done.returncode == 2 and "no variant 'nope'" in done.stderr


def test_ratio_runs_without_runs_says_why(tmp_path, monkeypatch):
    write_rows(tmp_path / "a-1.json", monkeypatch, [])
    done = subprocess.run([sys.executable, str(TOOLS / "ratio_runs.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "--pipeline" in done.stderr
    (tmp_path / "b-1.json").write_text("{not json")
    done = subprocess.run([sys.executable, str(TOOLS / "ratio_runs.py"), str(tmp_path / "b-1.json")],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "ratio_runs:" in done.stderr


def test_json_is_refused_before_any_benchmark_runs(tmp_path):
    """A bad --json is an exit 2 with its reason at once (no GPU needed to find out)."""
    for extra, why in ((["--flood", "--json", str(tmp_path / "x.json")], "--json is for the host benchmark"),
                       (["--restart", "--json", str(tmp_path / "x.json")], "--json is for the host benchmark"),
                       (["--gpu", "--json", str(tmp_path / "no" / "x.json")], "no directory")):
        done = subprocess.run([sys.executable, "-m", "kvd", "bench", *extra],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and why in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())


def test_ab_runs_refuses_bad_labels():
    done = subprocess.run(["bash", str(TOOLS / "ab_runs.sh")], capture_output=True, text=True,
                          env={**os.environ, "VARIANTS": "ok|;bad/label|X=1"}, timeout=30)
    assert done.returncode == 2 and "bad label 'bad/label'" in done.stderr


def test_ab_runs_rotates_the_variants_and_keeps_daemon_logs(tmp_path):
    """Each round starts one variant later (none always runs first), each run gets its
    variant's environment, and DAEMON_LOG=1 adds the daemon's log and its timings. The
    ``python3`` on PATH is a stand-in that records what it was asked to run (the bench
    needs a GPU; what is tested here is the script's order and arguments)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "${{X:-none}} $*" >> {calls}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ROUNDS": "3",
           "VARIANTS": "a|;b|X=1;c|X=2|--more 3", "OUT": str(tmp_path / "out")}
    for log in ("0", "1"):
        calls.unlink(missing_ok=True)
        done = subprocess.run(["bash", str(TOOLS / "ab_runs.sh"), "--flag"], capture_output=True,
                              text=True, env={**env, "DAEMON_LOG": log}, timeout=60)
        assert done.returncode == 0, done.stderr
        lines = calls.read_text().splitlines()
        runs = [line.split() for line in lines if " bench " in line]
        order = [r[-1].rsplit("/", 1)[1] for r in runs]
        assert order == ["a-1.json", "b-1.json", "c-1.json", "b-2.json", "c-2.json",
                         "a-2.json", "c-3.json", "a-3.json", "b-3.json"], order
        assert all(r[0] == {"a": "none", "b": "1", "c": "2"}[o[0]] for r, o in zip(runs, order))
        # a variant's own flags follow the common ones, for that variant alone
        assert all((r[6:8] == ["--more", "3"]) == (o[0] == "c") for r, o in zip(runs, order))
        with_log = [r for r in runs if "--daemon-log" in r]
        assert len(with_log) == (9 if log == "1" else 0)
        assert sum("daemon_timings.py" in line for line in lines) == len(with_log)
        assert lines[-1].split()[1:] == ["tools/ratio_runs.py", str(tmp_path / "out"), "--base",
                                         "a"]


def test_ab_runs_runs_a_tree_variant_from_that_tree(tmp_path):
    """TREE=DIR: that variant's runs start in DIR with DIR's packages first on PYTHONPATH
    (the other variant's from the repository, PYTHONPATH as given), and write their
    results into OUT all the same."""
    bin_dir, calls, old = tmp_path / "bin", tmp_path / "calls", tmp_path / "old_tree"
    bin_dir.mkdir()
    old.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$PWD|$PYTHONPATH|$*" >> "{calls}"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ROUNDS": "2",
           "PYTHONPATH": "/given", "VARIANTS": f"old|TREE={old};new|", "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(TOOLS / "ab_runs.sh"), "--flag"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    runs = [line.split("|") for line in calls.read_text().splitlines() if " bench " in line]
    repo = str(TOOLS.parent)
    assert [(cwd, path, args.split()[-1].rsplit("/", 1)[1]) for cwd, path, args in runs] == [
        (str(old), f"{old}/clients:{old}:/given", "old-1.json"), (repo, "/given", "new-1.json"),
        (repo, "/given", "new-2.json"), (str(old), f"{old}/clients:{old}:/given", "old-2.json")]
    assert all(args.split()[-1].startswith(f"{tmp_path}/out/") for _, _, args in runs)


def test_host_tier_bench_times_the_journals_delayed_records():
    """--journal --journal-delay: a row without the journal, one with it, and the delayed
    records' time on the loop in the journal row's flush column (none without a delay)."""
    rows = {}
    for delay in ("0", "0.01"):
        done = subprocess.run([sys.executable, str(TOOLS / "host_tier_bench.py"), "--sizes", "300",
                               "--leased", "0", "--chunks", "32", "--requests", "300",
                               "--journal", "--journal-delay", delay],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        rows[delay] = [line.split() for line in done.stdout.splitlines()[2:]]
    for delay, (plain, journal) in rows.items():
        assert plain[0] == journal[0] == "300" and journal[-1] == "journal" and len(plain) == 6
        assert float(plain[5]) == 0 and (float(journal[5]) > 0) == (delay != "0"), rows


def test_daemon_timings_report_each_phases_time_on_the_gpu(tmp_path):
    """tools/daemon_timings.py --phases: copy lines that carry their time on the GPU
    (kvd.cuda.backend, DMA copies with debug logging) give each direction of a phase the
    median copy's GPU time and its GB/s; lines without it (older logs, kernel paths) give
    none, and the rest of the line stays as it was."""
    def line(what: str, began: float, gpu_ms: float | None) -> str:
        tail = "" if gpu_ms is None else f", on the GPU {gpu_ms:.3f} ms"
        return (f"2026-11-27 03:47:56,180 kvd DEBUG {what} of 128 chunks, 144.0 MB, DMA: enqueued "
                f"in 0.500 ms, landed after 4.000 ms (36.0 GB/s), began {began:.6f}{tail}")
    copies = [line("gather", 10 + 0.004 * k, 2.0 + k % 2) for k in range(6)]
    copies += [line("scatter", 10.001 + 0.004 * k, None) for k in range(6)]
    log = tmp_path / "daemon.log"
    log.write_text("\n".join(copies) + "\n")
    done = subprocess.run([sys.executable, str(TOOLS / "daemon_timings.py"), str(log), "--phases"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    phase = [x for x in done.stdout.splitlines() if "gather n=6" in x]
    assert len(phase) == 1, done.stdout
    gather, scatter = phase[0].split("; ")
    assert "on the GPU 2.50 ms (57.6 GB/s)" in gather  # median of 2, 3, 2, 3, 2, 3
    assert scatter.startswith("scatter n=") and "on the GPU" not in scatter


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
