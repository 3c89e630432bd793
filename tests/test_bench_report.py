"""kvd.bench.pipeline.report: the pipelined table as engines' users read it (no GPU).

Rows as ``measure`` returns them: a phase that ran has its GB/s, its
memcpy baseline's GB/s, the median of the runs' ratios and each run's ratio;
a phase left out (``--pipeline-phases``) is NaN and has no runs. The table
prints each ratio as measured against its own baseline (not recomputed from
the medians) and the spread of the runs of every phase that ran.
"""

from __future__ import annotations

from kvd.bench.pipeline import report


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
            row("deepseek-mla", both=(59.3, 86.5, [0.66, 0.78, 0.69]))])
    out = capsys.readouterr().out
    lines = out.splitlines()
    llama = next(line for line in lines if line.startswith("llama3-8b"))
    assert llama.split() == ["llama3-8b", "16", "54.5", "0.98", "53.0", "0.99", "83.8", "0.98",
                             "55.1/53.5/85.5"]
    mla = lines[lines.index(next(line for line in lines if line.startswith("deepseek-mla"))) + 1]
    assert "both 0.66-0.78" in mla and "store" not in mla  # only the phase that ran
    assert "ratio of each run: store 0.97-0.99, load 0.98-1.00, both 0.95-1.02" in out
    assert "right before the run" in out


def test_no_rows_print_nothing(capsys):
    report([])
    assert capsys.readouterr().out == ""
