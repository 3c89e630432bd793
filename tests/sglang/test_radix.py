"""kvd's radix cache for SGLang 0.5.16 (kvd_client.sglang.radix) against SGLang's own classes, on the CPU.

A worker (radix_worker.py) runs SGLang 0.5.16 (``make setup-sglang016``: its sources beside the
SGLang venv's torch) with its device pool, paged allocator, request slots, plugin loader and
``create_tree_cache``, against a real ``kvd serve``. Requests are SGLang's own ``Req``, admitted
by its ``PrefillAdder`` (which loads a host hit back); each engine "computes" the rest with
bytes of its own seed, so a page that holds another engine's bytes came from kvd. Checked: a second engine loads the first one's
pages byte for byte and computes only the rest, behind its own GPU prefix too; a stored page
stays locked in the tree until its store ended; no daemon, or the plain class on a CPU, is a
miss and every request still completes; a load that fails after its hit (the daemon
killed in between) frees its slots and the request is computed, every slot still free or in the
tree (SGLang's idle check); the entry point registers ``kvd`` through SGLang's
plugin loader; bad options stop SGLang at start; TP-2 (two worker processes, a gloo group):
each rank loads its own shard, and a hit one rank lacks is taken by neither.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
from test_hicache import ROOT, Worker, WorkerError, _sglang_python, daemon  # noqa: F401

RADIX_WORKER = Path(__file__).resolve().parent / "radix_worker.py"
SGLANG_016 = Path(os.environ.get("KVD_SGLANG016_SRC") or ROOT / ".sglang-0.5.16")
pytestmark = pytest.mark.skipif(
    _sglang_python() is None or not (SGLANG_016 / "sglang" / "__init__.py").exists(),
    reason=f"no SGLang 0.5.16 sources at {SGLANG_016} beside the SGLang venv (make setup-sglang016)")

PAGE = 16
_starts = itertools.count(9_000_000, 10_000)


def tokens(n: int) -> list[int]:
    start = next(_starts)
    return list(range(start, start + n))


@pytest.fixture(scope="module")
def rw(tmp_path_factory):
    env = {"PYTHONPATH": f"{SGLANG_016}{os.pathsep}{ROOT / 'clients'}"}
    w = Worker(_sglang_python(), tmp_path_factory.mktemp("radix") / "worker.log", RADIX_WORKER, env)
    yield w
    w.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two SGLang processes: TP ranks 0 and 1 (a gloo group between them)."""
    env = {"PYTHONPATH": f"{SGLANG_016}{os.pathsep}{ROOT / 'clients'}"}
    logs = tmp_path_factory.mktemp("radix-tp")
    ws = [Worker(_sglang_python(), logs / f"rank{r}.log", RADIX_WORKER, env) for r in range(2)]
    yield ws
    for w in ws:
        w.close()


def both(ws, op: str, per_rank=({}, {}), **fields) -> list:
    """``op`` on both ranks at once (their collectives meet), then both answers."""
    for w, own in zip(ws, per_rank):
        w.proc.stdin.write(json.dumps({"op": op, **fields, **own}) + "\n")
        w.proc.stdin.flush()
    return [w._reply() for w in ws]


@pytest.fixture
def engines(rw):
    made = []

    def make(runtime_dir, name, **kw):
        extra = {"kvd_runtime_dir": str(runtime_dir), **kw.pop("extra", {})}
        made.append(name)
        assert rw("engine", name=name, extra=extra, **kw) in ("ShmRadixCache", "KvdRadixCache")
        return lambda op, **f: rw(op, name=name, **f)

    yield make
    for name in made:
        try:
            rw("close", name=name)
        except WorkerError:
            pass


def test_a_second_engine_loads_the_first_ones_pages_and_computes_the_rest(daemon, engines):
    a = engines(daemon.runtime_dir, "a", seed=1)
    b = engines(daemon.runtime_dir, "b", seed=2)
    toks = tokens(4 * PAGE + 5)                 # 4 whole pages and a tail
    first = a("request", tokens=toks)
    assert first["kvd"] == 0 and first["device"] == 0
    stats = a("drain")
    assert stats["stored_tokens"] == 4 * PAGE and stats["failed_stores"] == 0
    second = b("request", tokens=toks)
    assert second["device"] == 0 and second["kvd"] == 4 * PAGE and second["loaded"] == 4 * PAGE
    assert second["pages"] == first["pages"]    # byte for byte, every layer, K and V
    books = b("accounting")                     # the loaded slots joined the tree, none lost
    assert books["available"] + books["evictable"] + books["protected"] == books["total"], books
    again = b("request", tokens=toks)            # now in b's own tree: no kvd round
    assert again["device"] == 4 * PAGE and again["kvd"] == 0
    assert b("stats")["loaded_tokens"] == 4 * PAGE


def test_kvd_adds_the_pages_past_the_engines_own_gpu_prefix(daemon, engines):
    a = engines(daemon.runtime_dir, "a", seed=3)
    b = engines(daemon.runtime_dir, "b", seed=4)
    toks = tokens(6 * PAGE)
    stored = a("request", tokens=toks)["pages"]
    a("drain")
    own = b("request", tokens=toks[:2 * PAGE])["pages"]      # b computed the first two pages
    got = b("request", tokens=toks)
    assert got["device"] == 2 * PAGE and got["kvd"] == 4 * PAGE - PAGE
    # b's own two pages stay; kvd fills pages 3-5; the last page is computed (SGLang needs
    # at least one token to compute: kvd answers whole pages before it)
    assert got["pages"][:2] == own and got["pages"][2:5] == stored[2:5]
    assert got["pages"][5] != stored[5]


def test_a_stored_page_stays_locked_in_the_tree_until_its_store_ended(daemon, engines):
    a = engines(daemon.runtime_dir, "a", seed=7)
    a("request", tokens=tokens(3 * PAGE + 1))
    assert a("sizes") == {"protected": 3 * PAGE, "evictable": 0}   # the store still holds it
    assert a("drain")["stored_tokens"] == 3 * PAGE
    assert a("sizes") == {"protected": 0, "evictable": 3 * PAGE}


def test_a_load_that_fails_frees_its_slots_and_the_request_is_computed(start_daemon, engines):
    d = start_daemon()
    a = engines(d.runtime_dir, "fa", seed=8)
    b = engines(d.runtime_dir, "fb", seed=9, extra={"kvd_timeout_s": 5.0})
    toks = tokens(4 * PAGE + 5)
    stored = a("request", tokens=toks)["pages"]
    assert a("drain")["stored_tokens"] == 4 * PAGE
    assert b("match", tokens=toks)["kvd"] == 4 * PAGE   # a hit, pinned under a lease
    d.kill()                                            # the daemon dies before the load
    got = b("admit")
    assert got["loaded"] == 0 and b("stats")["failed_loads"] == 1
    assert all(mine != theirs for mine, theirs in zip(got["pages"], stored))  # b computed them
    b("drain")
    books = b("accounting")  # every slot free or in the tree: SGLang's idle check holds
    assert books["available"] + books["evictable"] + books["protected"] == books["total"], books
    assert books["evictable"] == 4 * PAGE and books["protected"] == 0, books
    again = b("request", tokens=toks)  # the tree holds b's own pages, not half-loaded ones
    assert again["device"] == 4 * PAGE and again["pages"] == got["pages"]


def test_without_a_daemon_every_request_is_computed(engines, tmp_path):
    x = engines(tmp_path / "nothing", "x", seed=5)
    toks = tokens(3 * PAGE)
    got = x("request", tokens=toks)
    assert got["kvd"] == 0 and len(got["pages"]) == 3
    assert x("stats")["registered"] is False


def test_on_a_cpu_the_plain_class_says_why_and_misses(daemon, engines):
    p = engines(daemon.runtime_dir, "p", backend="kvd", seed=6)  # the entry point's name
    got = p("request", tokens=tokens(2 * PAGE))
    assert got["kvd"] == 0
    stats = p("stats")
    assert stats["registered"] is False and "CUDA" in stats["refused"]


def test_pyproject_offers_the_entry_point_sglang_loads():
    import tomllib

    from kvd_client.sglang import plugin

    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert points["sglang.srt.plugins"] == {plugin.NAME: plugin.ENTRY_POINT}


def test_bad_options_stop_sglang_at_start(rw, daemon):
    extra = {"kvd_runtime_dir": str(daemon.runtime_dir)}
    with pytest.raises(WorkerError, match="unknown kvd option"):
        rw("engine", name="bad", extra={**extra, "kvd_no_such_option": 1})
    with pytest.raises(WorkerError, match="kvd_key_mode must be 'tokens'"):
        rw("engine", name="bad", extra={**extra, "kvd_key_mode": "hashes"})
    with pytest.raises(WorkerError, match="pipeline parallelism is not supported"):
        rw("engine", name="bad", extra=extra, pp_size=2)


@pytest.mark.timeout(180)  # ranks that disagree would wait for each other for ever
def test_tp_ranks_load_their_own_shards_and_agree_on_every_hit(daemon, pair, tmp_path):
    init, good = str(tmp_path / "gloo"), {"kvd_runtime_dir": str(daemon.runtime_dir)}
    ranks = lambda seed, extra1=good: [{"tp_rank": 0, "seed": seed, "extra": good},  # noqa: E731
                                       {"tp_rank": 1, "seed": seed + 1, "extra": extra1}]
    toks = tokens(3 * PAGE + 1)
    made = []
    try:
        for name, seed, extra1 in (("ta", 20, good), ("tb", 30, good),
                                   ("tc", 40, {"kvd_runtime_dir": str(tmp_path / "no-daemon")})):
            both(pair, "engine", ranks(seed, extra1), name=name, tp_size=2, dist=init)
            made.append(name)
        stored = both(pair, "request", name="ta", tokens=toks)
        assert all(s["stored_tokens"] == 3 * PAGE for s in both(pair, "drain", name="ta"))
        got = both(pair, "request", name="tb", tokens=toks)
        for rank in (0, 1):  # each rank its own shard, byte for byte
            assert got[rank]["kvd"] == 3 * PAGE and got[rank]["pages"] == stored[rank]["pages"]
        assert stored[0]["pages"] != stored[1]["pages"]
        # rank 1 has no daemon: rank 0's hit is not taken either, the trees stay alike
        assert [g["kvd"] for g in both(pair, "request", name="tc", tokens=toks)] == [0, 0]
    finally:
        for name in made:
            both(pair, "close", name=name)
