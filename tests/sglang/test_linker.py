"""kvd's UnifiedCacheLinker (kvd_client.sglang.linker) against SGLang's own classes, on the CPU.

A worker in the SGLang venv (linker_worker.py: SGLang's device pools, paged
allocator, ``PoolTransfer``, page hashing, and the linker made by SGLang's
``create_unified_cache_linker``) against a real ``kvd serve``. Needs SGLang
≥ 0.5.23 (the linker interface); skipped on older SGLang and without the venv.
"""

from __future__ import annotations

import base64
import itertools
import json
import subprocess
import time
from pathlib import Path

import pytest
from daemons import wait_for
from test_hicache import WORKER, Worker, WorkerError, _sglang_python, daemon  # noqa: F401

LINKER_WORKER = Path(__file__).resolve().parent / "linker_worker.py"


def _has_linker(python: str | None) -> bool:
    if python is None:
        return False
    probe = "import sglang.srt.mem_cache.unified_cache.unified_cache_linker as m; m.UnifiedCacheLinker"
    return subprocess.run([python, "-c", probe], capture_output=True, timeout=300).returncode == 0


pytestmark = pytest.mark.skipif(not _has_linker(_sglang_python()),
                                reason="no SGLang >= 0.5.23 venv (make setup-sglang, or KVD_SGLANG_PYTHON)")

_starts = itertools.count(7_000_000, 10_000)


def tokens(n: int) -> list[int]:
    start = next(_starts)
    return list(range(start, start + n))


@pytest.fixture(scope="module")
def lw(tmp_path_factory):
    w = Worker(_sglang_python(), tmp_path_factory.mktemp("linker") / "worker.log", LINKER_WORKER)
    yield w
    w.close()


@pytest.fixture(scope="module")
def hw(tmp_path_factory):
    w = Worker(_sglang_python(), tmp_path_factory.mktemp("hicache") / "worker.log", WORKER)
    yield w
    w.close()


@pytest.fixture
def engines(lw):
    made = []

    def make(daemon_dir, name, **kw):
        extra = {"kvd_runtime_dir": str(daemon_dir), **kw.pop("extra", {})}
        lw("engine", name=name, extra=extra, **kw)
        made.append(name)
        return lambda op, **f: lw(op, name=name, **f)

    yield make
    for name in made:
        try:
            lw("close", name=name)
        except WorkerError:
            pass


@pytest.mark.parametrize("mla", [False, True])
def test_offloaded_pages_load_layer_by_layer_into_another_device_pool(daemon, engines, mla):
    a = engines(daemon.runtime_dir, "a", mla=mla)
    b = engines(daemon.runtime_dir, "b", mla=mla)
    toks = tokens(4 * 16)
    keys = a("hash", tokens=toks)
    stored = a("offload", keys=keys, seed=1)
    assert stored["queued"] and stored["ok"]
    assert b("lookup", keys=b("hash", tokens=toks)) == [1, 2, 3, 4]
    got = b("load", keys=keys, rid="r1")
    assert got["queued"] and got["landed"]
    assert got["pages"] == stored["pages"]  # byte for byte, every layer, K and V
    stats = b("stats")
    assert stats["registered"] and stats["loaded_batches"] == 1 and stats["failed_loads"] == 0


def test_a_hit_stops_at_the_first_page_kvd_lacks(daemon, engines):
    a = engines(daemon.runtime_dir, "a")
    b = engines(daemon.runtime_dir, "b")
    toks = tokens(5 * 16)
    keys = a("hash", tokens=toks)
    assert a("offload", keys=keys[:3], seed=2)["ok"]
    assert b("lookup", keys=b("hash", tokens=toks)) == [1, 2, 3]
    got = b("load", keys=keys[:3])
    assert got["landed"]


def test_pages_the_hicache_backend_stored_are_a_linker_hit_with_the_same_bytes(daemon, engines, hw):
    """One namespace: SGLang's host pool (HiCache backend) and its GPU pool (linker)."""
    hw("engine", name="h", layout="page_first", extra={"kvd_runtime_dir": str(daemon.runtime_dir)})
    try:
        toks = tokens(3 * 16)
        keys = hw("hash", name="h", tokens=toks)
        stored = hw("fill_set", name="h", keys=keys, seed=3)
        assert stored["results"] == [True] * 3
        b = engines(daemon.runtime_dir, "b")
        assert b("lookup", keys=b("hash", tokens=toks)) == [1, 2, 3]
        got = b("load", keys=keys)
        assert got["landed"]
        assert [base64.b64decode(p) for p in got["pages"]] == \
            [base64.b64decode(p) for p in stored["pages"]]
    finally:
        hw("close", name="h")


def test_unknown_tokens_misaligned_slots_and_cancelled_loads_move_nothing(daemon, engines):
    a = engines(daemon.runtime_dir, "a")
    b = engines(daemon.runtime_dir, "b")
    toks = tokens(2 * 16)
    keys = a("hash", tokens=toks)
    assert a("offload", keys=keys, seed=4)["ok"]
    assert b("lookup", keys=["not-a-hash-b-saw"]) == []      # tokens never hashed here: a miss
    b("hash", tokens=toks)
    assert b("load", keys=keys, shift_slots=1) == {"queued": False}  # not page-aligned: refused
    out = b("queue_and_cancel", keys=keys)
    assert out == {"queued": True, "cancelled": True, "start": -1}  # nothing left to start
    assert b("stats")["refused_transfers"] == 1


def test_without_a_daemon_it_misses_and_on_the_cpu_kvd_linker_says_why(daemon, engines, tmp_path):
    gone = engines(tmp_path / "nothing", "x")
    assert gone("lookup", keys=gone("hash", tokens=tokens(32))) == []
    assert gone("stats")["registered"] is False
    plain = engines(daemon.runtime_dir, "p", kvd_linker=True)
    stats = plain("stats")
    assert stats["registered"] is False and "CUDA" in stats["refused"]


def test_bad_options_and_other_components_stop_sglang_at_start(lw, daemon):
    extra = {"kvd_runtime_dir": str(daemon.runtime_dir)}
    with pytest.raises(WorkerError, match="unknown kvd option"):
        lw("engine", name="bad", extra={**extra, "kvd_no_such_option": 1})
    with pytest.raises(WorkerError, match="only the full KV component"):
        lw("engine", name="bad", extra=extra, components=["FULL", "SWA"])


def test_the_timeline_records_each_call_with_monotonic_times(daemon, tmp_path):
    trace = tmp_path / "trace.jsonl"
    w = Worker(_sglang_python(), tmp_path / "worker.log", LINKER_WORKER,
               env={"KVD_SGLANG_TRACE": str(trace)})
    try:
        extra = {"kvd_runtime_dir": str(daemon.runtime_dir)}
        w("engine", name="a", extra=extra)
        toks = tokens(2 * 16)
        keys = w("hash", name="a", tokens=toks)
        assert w("offload", name="a", keys=keys, seed=5)["ok"]
        assert w("lookup", name="a", keys=keys) == [1, 2]
        assert w("load", name="a", keys=keys)["landed"]
        w("close", name="a")
    finally:
        w.close()
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    ops = [x["op"] for x in lines]
    polls = ops[1:ops.index("lookup")]  # SGLang's per-step question while the store ran
    assert ops[0] == "offload" and lines[0]["pages"] == 2 and set(polls) == {"poll_offloads"}
    assert ops[len(polls) + 1:] == ["lookup", "queue_load", "submit_loads", "finish_loads"]
    assert all(x["src"] == "linker" and x["t0"] <= x["t1"] for x in lines)
    by_op = {x["op"]: x for x in lines}
    assert by_op["lookup"]["hit_pages"] == 2 and by_op["finish_loads"]["landed"] is True
    assert by_op["poll_offloads"]["queued"] == 1 and by_op["queue_load"]["pages"] == 2


def test_with_offload_off_it_stores_nothing_and_still_loads_what_others_stored(daemon, engines):
    a = engines(daemon.runtime_dir, "a")
    ro = engines(daemon.runtime_dir, "ro", extra={"kvd_offload": False})
    toks = tokens(2 * 16)
    keys = ro("hash", tokens=toks)
    assert ro("offload", keys=keys, seed=8)["queued"] is False  # SGLang keeps it on the GPU
    assert ro("lookup", keys=keys, rid="m") == []
    assert a("offload", keys=a("hash", tokens=toks), seed=8)["ok"]
    assert ro("lookup", keys=keys, rid="h") == [1, 2]
    assert ro("load", keys=keys, rid="h")["landed"]
    assert ro("stats")["stored_pages"] == 0


def test_a_lookup_pins_its_hits_until_the_load_consumes_or_a_cancel_releases_them(daemon, engines):
    a = engines(daemon.runtime_dir, "a")
    b = engines(daemon.runtime_dir, "b")
    toks = tokens(2 * 16)
    keys = a("hash", tokens=toks)
    assert a("offload", keys=keys, seed=6)["ok"]
    b("hash", tokens=toks)
    assert b("lookup", keys=keys, rid="x") == [1, 2]
    assert daemon.stats()["leases"] == 1          # pinned: no eviction before the load
    assert b("load", keys=keys, rid="x")["landed"]
    wait_for(lambda: daemon.stats()["leases"] == 0, 5, "the load to consume the lease")
    assert b("lookup", keys=keys, rid="c") == [1, 2]
    assert b("queue_and_cancel", keys=keys)["cancelled"]
    wait_for(lambda: daemon.stats()["leases"] == 0, 5, "the cancel to release the lease")


def test_a_waiting_requests_matches_reuse_one_answer_for_half_its_lease(daemon, engines):
    """SGLang matches a waiting request on every scheduler pass: the same uncached pages are
    answered from the last lookup (hit or miss) while its lease (kvd_timeout_s) has half to run."""
    a = engines(daemon.runtime_dir, "a", extra={"kvd_timeout_s": 1.0})
    keys = a("hash", tokens=tokens(2 * 16))
    assert a("lookup", keys=keys, rid="w") == []            # a miss, remembered
    assert a("offload", keys=keys, seed=3)["ok"]
    assert a("lookup", keys=keys, rid="w") == []            # the same pages again: the same answer
    assert (a("stats")["lookups"], a("stats")["reused_answers"]) == (1, 1)
    assert a("lookup", keys=keys[:1], rid="w") == [1]       # other pages (a longer GPU prefix): asked
    time.sleep(0.6)                                          # past half the lease: asked again
    assert a("lookup", keys=keys[:1], rid="w") == [1]
    assert a("lookup", keys=keys, rid="w") == [1, 2]
    assert a("stats")["lookups"] == 4
    assert daemon.stats()["leases"] == 1                    # each new lookup let the last lease go
    assert a("load", keys=keys, rid="w")["landed"]          # consumed: the next match asks kvd
    assert a("lookup", keys=keys, rid="w") == [1, 2] and a("stats")["lookups"] == 5
