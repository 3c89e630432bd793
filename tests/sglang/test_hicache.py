"""KvdHiCacheStorage inside SGLang's real HiCache classes, against a real daemon.

An SGLang-side process (tests/sglang/sglang_worker.py, in the SGLang venv:
``make setup-sglang``, found through ``KVD_SGLANG_PYTHON`` or
``.venv-sglang``) builds SGLang's own device and host pools on the CPU
(0.5.23; 0.5.16 too, where that venv holds it), creates the backend through
``StorageBackendFactory`` the ``dynamic`` way, and hashes pages with
SGLang's ``get_storage_hash_str`` (0.5.16: ``get_hash_str``). Covered here:
SGLang engines among themselves (host layouts, the shared host pool, the
generic interface, prefix hits, key modes, TP, no daemon, bad options). The
worker and the fixtures here also serve test_hicache_vllm.py (vLLM engines'
chunks as SGLang hits and back), test_linker.py and test_radix.py.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from daemons import SESSION_TAGS, DaemonProc

from kvd_protocol.runtime import instance_tag

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "sglang_worker.py"


def _sglang_python() -> str | None:
    path = os.environ.get("KVD_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
    return path if Path(path).exists() else None


pytestmark = pytest.mark.skipif(_sglang_python() is None,
                                reason="no SGLang venv (make setup-sglang, or KVD_SGLANG_PYTHON)")


class WorkerError(Exception):
    pass


class Worker:
    def __init__(self, python: str, log_path: Path, script: Path = WORKER, env: dict | None = None):
        venv = Path(python).absolute().parents[1]
        # the caller's path after ours: on the GPU machine SGLang itself is there (a staged site)
        path = os.pathsep.join(p for p in (str(ROOT / "clients"), os.environ.get("PYTHONPATH")) if p)
        # SGLang's JIT builds (0.5.23's page hash) per venv, each against its own torch; where the
        # venv is not ours to write (the GPU machine's image) torch's default place
        builds = {"TORCH_EXTENSIONS_DIR": str(venv / "torch_extensions")} if os.access(venv, os.W_OK) else {}
        env = {**os.environ, "PYTHONPATH": path, **builds,
               "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python", **(env or {})}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([python, str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self._reply()

    def __call__(self, op: str, **fields):
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def _reply(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the SGLang worker died:\n{Path(self.log.name).read_text()[-3000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(reply["error"])
        return reply["ok"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def sgl(tmp_path_factory):
    w = Worker(_sglang_python(), tmp_path_factory.mktemp("sglang") / "worker.log")
    yield w
    w.close()


@pytest.fixture(scope="module")
def daemon():
    """One daemon for the tests that need nothing special of it (each uses its own tokens)."""
    base = Path(tempfile.mkdtemp(prefix="kvd-t-", dir="/tmp"))
    d = DaemonProc(base / "run", {})
    SESSION_TAGS.add(instance_tag(d.runtime_dir))
    d.start()
    yield d
    code = d.stop()
    d.remove_host_tier()
    shutil.rmtree(base, ignore_errors=True)
    assert code == 0, f"kvd exited with {code}:\n{d.log()}"


_starts = itertools.count(1000, 10_000)


def tokens(n: int) -> list[int]:
    """``n`` token ids no other test of the module uses."""
    start = next(_starts)
    return list(range(start, start + n))


class Engine:
    """One SGLang rank in the worker; closed by the test's ``engines`` fixture."""

    def __init__(self, sgl, daemon_dir, name, **kw):
        extra = {"kvd_runtime_dir": str(daemon_dir), **kw.pop("extra", {})}
        self.sgl, self.name, self.page_size = sgl, name, kw.get("page_size", 16)
        sgl("engine", name=name, extra=extra, **kw)

    def hash(self, tokens, **salts):
        return self.sgl("hash", name=self.name, tokens=list(tokens), **salts)

    def __getattr__(self, op):
        return lambda **fields: self.sgl(op, name=self.name, **fields)


@pytest.fixture
def engines(sgl):
    made = []

    def make(daemon_dir, name, **kw):
        made.append(Engine(sgl, daemon_dir, name, **kw))
        return made[-1]

    yield make
    for e in made:
        try:
            e.close()
        except WorkerError:
            pass


def pages_bytes(pages: list[str]) -> list[bytes]:
    return [base64.b64decode(p) for p in pages]


MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


@pytest.mark.parametrize("mla, layout", [(False, x) for x in MHA_LAYOUTS] + [(True, x) for x in MLA_LAYOUTS])
def test_pages_round_trip_between_layouts(daemon, engines, mla, layout):
    """Store from one host layout, load into another: the same bytes in page order."""
    a = engines(daemon.runtime_dir, "a", layout=layout, mla=mla)
    b = engines(daemon.runtime_dir, "b", layout="page_first" if layout == "layer_first" else "layer_first",
                mla=mla)
    prompt = tokens(80)
    keys = a.hash(prompt[:64])
    assert len(keys) == 4 and a.exists(keys=keys) == 0
    stored = a.fill_set(keys=keys, seed=1)
    assert stored["results"] == [True] * 4
    assert b.hash(prompt[:64]) == keys and b.exists(keys=keys) == 4
    got = b.get(keys=keys)
    assert got["results"] == [True] * 4
    assert pages_bytes(got["pages"]) == pages_bytes(stored["pages"])
    assert b.exists(keys=b.hash(prompt)) == 4  # a longer prompt: its first 4 pages


@pytest.mark.parametrize("mla, layout", [(False, x) for x in MHA_LAYOUTS] + [(True, x) for x in MLA_LAYOUTS])
def test_a_shared_host_pool_moves_pages_in_place_and_shares_entries_with_staging(daemon, engines,
                                                                                 mla, layout):
    """``host_pool`` 'shared': SGLang's host pool moved into a file kvd maps, pages loaded and
    stored in place; the entries are the staging backend's, both ways, byte for byte."""
    shared = {"kvd_host_pool": "shared"}
    a = engines(daemon.runtime_dir, "a", layout=layout, mla=mla, extra=shared)
    b = engines(daemon.runtime_dir, "b", layout="page_first" if layout == "layer_first" else "layer_first",
                mla=mla)
    prompt = tokens(64)
    keys = a.hash(prompt)
    stored = a.fill_set(keys=keys, seed=3)  # filled through SGLang's own tensors, stored in place
    assert stored["results"] == [True] * 4
    assert a.stats()["host_pool"] == "shared", a.stats()
    got = b.get(keys=keys)
    assert got["results"] == [True] * 4 and pages_bytes(got["pages"]) == pages_bytes(stored["pages"])
    other = tokens(64)
    staged = b.fill_set(keys=b.hash(other), seed=4)
    assert staged["results"] == [True] * 4
    loaded = a.get(keys=a.hash(other))  # into fresh host slots, read back through SGLang's views
    assert loaded["results"] == [True] * 4 and pages_bytes(loaded["pages"]) == pages_bytes(staged["pages"])
    stats = a.stats()
    assert (stats["stored_pages"], stats["loaded_pages"], stats["shared_refused"]) == (4, 4, None)


def test_a_host_pool_that_cannot_be_shared_is_staged_and_says_why(start_daemon, engines):
    d = start_daemon(chunk_tokens=16)
    a = engines(d.runtime_dir, "a", layout="page_first_direct", page_size=32,
                extra={"kvd_host_pool": "shared"})
    prompt = tokens(64)
    stored = a.fill_set(keys=a.hash(prompt), seed=5)
    assert stored["results"] == [True] * 2
    stats = a.stats()
    assert stats["host_pool"] == "staging" and "page_first_direct" in stats["shared_refused"]
    got = a.get(keys=a.hash(prompt))
    assert got["results"] == [True] * 2 and pages_bytes(got["pages"]) == pages_bytes(stored["pages"])


def test_generic_flat_page_interface(daemon, engines):
    """Without ``interface_v1`` SGLang uses the generic interface: the default shared host pool
    is of no use there, so the backend stages and says why."""
    a = engines(daemon.runtime_dir, "a", layout="page_head", extra={"interface_v1": 0})
    keys = a.hash(tokens(48))
    stored = a.fill_set_flat(keys=keys, seed=2)
    assert stored["ok"]
    stats = a.stats()
    assert stats["host_pool"] == "staging" and "interface_v1" in stats["shared_refused"], stats
    got = a.get_flat(keys=keys)
    assert got["results"] == [True] * 3 and pages_bytes(got["pages"]) == pages_bytes(stored["pages"])
    assert a.get_flat(keys=a.hash(tokens(48)))["results"] == [False] * 3


@pytest.mark.parametrize("pipeline", [8, 2, 3])
def test_a_prefix_hit_stops_at_the_first_miss(daemon, engines, pipeline):
    """Loads go to kvd ``pipeline`` pages a request while the copy threads deliver the last
    request's pages: the pages before the miss arrive whole, whichever request it falls in."""
    a = engines(daemon.runtime_dir, "a", extra={"kvd_load_pipeline_pages": pipeline})
    keys = a.hash(tokens(128))
    stored = a.fill_set(keys=keys[:5], seed=3)
    assert stored["results"] == [True] * 5 and a.exists(keys=keys) == 5
    got = a.get(keys=keys)
    assert got["results"] == [True] * 5 + [False] * 3
    assert pages_bytes(got["pages"]) == pages_bytes(stored["pages"])


def test_pages_hashed_through_a_reference_taken_early_are_keyed(daemon, engines):
    """SGLang 0.5.16's cache controller hashes prefetch queries through its own reference to
    ``get_hash_str``, taken before the backend exists: a fresh engine keys them all the same."""
    a = engines(daemon.runtime_dir, "a")
    prompt = tokens(48)
    keys = a.hash_early(tokens=prompt)
    stored = a.fill_set(keys=keys, seed=15)
    assert stored["results"] == [True] * 3
    a.close()
    b = engines(daemon.runtime_dir, "b")
    assert b.hash_early(tokens=prompt) == keys and b.exists(keys=keys) == 3
    assert pages_bytes(b.get(keys=keys)["pages"]) == pages_bytes(stored["pages"])


def test_pages_sglang_never_hashed_in_python_are_misses(daemon, engines):
    """The Rust radix tree's hashes never pass through Python: kvd cannot key them."""
    a = engines(daemon.runtime_dir, "a")
    unknown = [f"{i:064x}" for i in range(3)]
    assert a.fill_set(keys=unknown, seed=6)["results"] == [False] * 3
    assert a.exists(keys=unknown) == 0 and a.stats()["unkeyed_pages"] >= 3
    h = engines(daemon.runtime_dir, "h", extra={"kvd_key_mode": "hashes"})
    assert h.fill_set(keys=unknown, seed=6)["results"] == [True] * 3
    assert h.exists(keys=unknown) == 3
    s = engines(daemon.runtime_dir, "s", extra={"kvd_key_mode": "hashes", "kvd_salt": "tenant-b"})
    assert s.exists(keys=unknown) == 0  # another fixed salt: other entries
    assert a.exists(keys=a.hash(tokens(48))) == 0  # hash-keyed entries are not token entries


def test_tensor_parallel_entry_needs_every_rank(daemon, engines):
    r0 = engines(daemon.runtime_dir, "r0", heads=1, tp_size=2, tp_rank=0)
    r1 = engines(daemon.runtime_dir, "r1", heads=1, tp_size=2, tp_rank=1)
    prompt = tokens(32)
    keys = r0.hash(prompt)
    s0 = r0.fill_set(keys=keys, seed=7)
    assert s0["results"] == [True, True] and r0.exists(keys=keys) == 0  # rank 1's shards missing
    s1 = r1.fill_set(keys=r1.hash(prompt), seed=8)
    assert r0.exists(keys=keys) == 2 and r1.exists(keys=keys) == 2
    assert pages_bytes(r0.get(keys=keys)["pages"]) == pages_bytes(s0["pages"])
    assert pages_bytes(r1.get(keys=keys)["pages"]) == pages_bytes(s1["pages"])


def test_without_a_daemon_everything_misses_until_it_comes(start_daemon, engines, tmp_path):
    run = tmp_path / "run"
    a = engines(run, "a", extra={"kvd_timeout_s": 1.0})
    keys = a.hash(tokens(32))
    assert a.exists(keys=keys) == 0
    assert a.fill_set(keys=keys, seed=9)["results"] == [False, False]
    assert a.get(keys=keys)["results"] == [False, False]
    d = start_daemon(runtime_dir=run)
    deadline = time.monotonic() + 10
    while a.fill_set(keys=keys, seed=9)["results"] != [True, True]:
        assert time.monotonic() < deadline, "the backend never used the daemon that came"
        time.sleep(0.3)
    assert a.exists(keys=keys) == 2
    d.stop()
    assert a.exists(keys=keys) == 0 and a.get(keys=keys)["results"] == [False, False]


@pytest.mark.parametrize("extra, words", [
    ({"kvd_staging": 4}, "unknown kvd option 'kvd_staging'"),
    ({"kvd_timeout_s": "5"}, "must be a float"),
    ({"kvd_host_pool": "shared", "interface_v1": 0}, "needs SGLang's zero-copy interface"),
])
def test_configuration_errors_stop_sglang_at_attach(daemon, engines, extra, words):
    with pytest.raises(WorkerError, match=words):
        engines(daemon.runtime_dir, "bad", extra=extra)


def test_a_chunk_that_does_not_divide_the_page_leaves_kvd_unused(start_daemon, engines):
    d = start_daemon(chunk_tokens=32)
    a = engines(d.runtime_dir, "a", page_size=16)
    keys = a.hash(tokens(32))
    assert a.fill_set(keys=keys, seed=10)["results"] == [False, False]
    assert "chunk_tokens (32) must divide SGLang's page size (16)" in a.stats()["refused"]
