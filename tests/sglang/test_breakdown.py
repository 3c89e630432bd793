"""examples/sglang_breakdown.py: one hit's time cut at the backend's calls (no SGLang needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import sglang_breakdown as B  # noqa: E402


def line(op, t0, t1):
    return {"src": "backend", "op": op, "t0": t0, "t1": t1}


def test_the_segments_partition_the_request_and_leave_other_requests_out():
    lines = [line("batch_exists", 10.0, 10.001), line("batch_exists", 10.002, 10.003),
             line("batch_get_v1", 10.010, 10.030), line("kvd_load", 10.011, 10.029),
             line("batch_get_v1", 10.031, 10.041), line("kvd_load", 10.032, 10.040),
             line("batch_exists", 20.0, 20.001)]  # another request's
    cut = B.segments(lines, 9.990, 10.100, 0.015)
    sglang_parts = {k: cut.pop(k) for k in ("to_forward", "prefill", "reply", "queue")}
    assert sglang_parts == dict.fromkeys(sglang_parts)  # no SGLang timestamps given
    assert cut == pytest.approx({"before": 10.0, "exists": 2.0, "between": 9.0, "get": 30.0,
                                 "kvd": 26.0, "daemon": 15.0, "after": 59.0, "total": 110.0})
    parts = cut["before"] + cut["exists"] + cut["between"] + cut["get"] + cut["after"]
    assert parts == pytest.approx(cut["total"])
    assert B.segments(lines, 30.0, 31.0, 0.0) is None  # a miss: no call in the window


def test_sglangs_own_timestamps_cut_the_part_after_our_calls():
    lines = [line("batch_exists", 10.0, 10.001), line("batch_get_v1", 10.010, 10.030)]
    offset = -1000.0  # monotonic - wall clock: SGLang's times are wall-clock seconds
    sglang = {"forward_entry_time": 1010.035, "prefill_finished_time": 1010.080, "queue_time": 0.03}
    cut = B.segments(lines, 9.990, 10.100, 0.01, sglang, offset)
    assert cut["to_forward"] == pytest.approx(5.0) and cut["prefill"] == pytest.approx(45.0)
    assert cut["reply"] == pytest.approx(20.0) and cut["queue"] == pytest.approx(30.0)
    assert cut["to_forward"] + cut["prefill"] + cut["reply"] == pytest.approx(cut["after"])


def test_the_table_prints_medians_per_prefix_and_engine(tmp_path):
    cut = B.segments([line("batch_exists", 1.0, 1.002), line("batch_get_v1", 1.003, 1.01)],
                     0.999, 1.05, 0.004)
    rows = B.table({2048: {"shared": [cut, None, cut]}})
    assert rows[0].split() == ["prefix", "engine", *B.SEGMENTS]
    assert rows[1].split()[:2] == ["2048", "shared"] and len(rows) == 2
    assert B.read(tmp_path / "absent.jsonl") == []


def test_the_radix_cache_and_the_linker_are_cut_at_their_own_calls():
    radix = [line("lookup", 10.000, 10.001), line("load", 10.005, 10.025)]  # the copy inside
    cut = B.segments(radix, 9.990, 10.070, 0.018)
    assert cut["exists"] == pytest.approx(1.0) and cut["get"] == pytest.approx(20.0)
    assert cut["before"] == pytest.approx(10.0) and cut["after"] == pytest.approx(45.0)
    linker = [line("lookup", 10.000, 10.001), line("submit_loads", 10.004, 10.005),
              line("finish_loads", 10.050, 10.051)]  # the forward between the two
    cut = B.segments(linker, 9.990, 10.060, 0.03)
    assert cut["get"] == pytest.approx(2.0) and cut["between"] == pytest.approx(48.0)
    assert cut["after"] == pytest.approx(9.0) and cut["total"] == pytest.approx(70.0)
