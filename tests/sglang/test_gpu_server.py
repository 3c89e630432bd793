"""Real SGLang engines on a GPU with kvd's HiCache backend: hits, KV bytes, logprobs, counters.

Needs a CUDA GPU and SGLang importable by this python (skipped otherwise, e.g.
in CI): on the GPU machine, SGLang 0.5.16 staged by tools/gpu/stage_sglang.sh
and run through its call2.sh. ``kvd serve --gpu on`` and each engine run as
processes of their own (tests/sglang/gpu_server.py: ``sglang.Engine``,
hierarchical cache, kvd as its ``dynamic`` storage backend, triton
attention). The model is a 4-layer Llama written at test time with seeded
random weights (head size 128), so logits depend on the prefix.

Engine A computes two prompts (prefixes of 1024 and 512 tokens, whole
pages, plus a suffix) and SGLang backs their full pages up to kvd. Engine B,
fresh and with every KV byte poisoned first, serves the same two prompts and
a control (another prefix of 1024 tokens, the same suffix):

- B's storage hits are the prefixes (SGLang's ``cached_tokens_details``),
  the control none;
- B's GPU pages of the hit tokens are byte-identical to A's (SHA-256 of each
  page over every layer's K and V, read right after each request);
- the first token agrees and its top logprobs within bf16 noise, while the
  control's prefix moves them;
- the backend's counters and the daemon's agree on the pages moved.

Both ways the backend moves pages (``kvd_host_pool``): through its staging
pool, and with SGLang's host pool shared in place (kvd_client.sglang.shared_host:
CUDA's registration of the pool dropped and made again over the file).

The same with kvd's radix cache (``--radix-cache-backend kvd``, no HiCache):
engine A stores when each request ends, engine B loads straight into its GPU
pool; B's pages and first token are A's, the control's prefix moves them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import engine_procs
from engine_procs import top_diff
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1500)]
if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("no SGLang in this python (tools/gpu/stage_sglang.sh stages it for the GPU machine)",
                allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_spec = importlib.util.spec_from_file_location("tiny_llama", ROOT / "tests" / "vllm" / "tiny_llama.py")
tiny_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny_llama)

PAGE = CHUNK = 64               # SGLang's page, kvd's chunk
MODEL = {**tiny_llama.CONFIG, "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 128}
HITS = {"long": 1024, "short": 512, "control": 0}
LOGPROB_TOL = 0.05              # bf16 noise between a prompt computed whole and one partly loaded


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, MODEL["vocab_size"]) for _ in range(n)]


def prompts() -> dict[str, list[int]]:
    suffix = tokens("suffix", 40)
    return {"long": tokens("long", 1024) + suffix, "short": tokens("short", 512) + tokens("suffix2", 40),
            "control": tokens("control", 1024) + suffix}


def spawn(tmp: Path, name: str, spec: dict):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "clients"),
                                                        os.environ.get("PYTHONPATH", "")])}
    spec_path, out, log = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, str(HERE / "gpu_server.py"), str(spec_path), str(out)],
                            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    return proc, out, log


def finish(run) -> dict:
    return engine_procs.result(run, 540)  # one GPU run lasts 600 s at most


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama.write(tmp_path_factory.mktemp("sgl-llama"), config=MODEL, std=0.05)


@pytest.mark.parametrize("host_pool", ["staging", "shared"])
def test_a_fresh_engine_loads_what_another_stored_byte_for_byte(model, start_daemon, tmp_path, host_pool):
    daemon = start_daemon(gpu="on", chunk_tokens=CHUNK, host_capacity="1GiB",
                          client_timeout_s=30.0, heartbeat_interval_s=1.0)
    kvd = {"kvd_runtime_dir": str(daemon.runtime_dir), "kvd_timeout_s": 10.0, "kvd_staging_pages": 32,
           "kvd_host_pool": host_pool}
    p = prompts()
    stored_pages = (HITS["long"] + HITS["short"]) // PAGE
    a = finish(spawn(tmp_path, "store", {"model": str(model), "kvd": kvd, "page_size": PAGE,
                                         "prompts": [p["long"], p["short"]],
                                         "wait_stored_pages": stored_pages}))
    assert a["backend"]["stored_pages"] >= stored_pages, a["backend"]
    assert daemon.stats()["chunks_stored"] >= stored_pages * PAGE // CHUNK
    b = finish(spawn(tmp_path, "load", {"model": str(model), "kvd": kvd, "page_size": PAGE,
                                        "poison": 0.75, "prompts": [p["long"], p["short"], p["control"]]}))
    check(a, b)
    assert (a["backend"]["host_pool"], b["backend"]["host_pool"]) == (host_pool, host_pool), \
        (a["backend"], b["backend"])
    st = daemon.stats()
    assert st["chunks_loaded"] == stored_pages * PAGE // CHUNK, st
    assert daemon.proc.poll() is None and daemon.control("health")["status"] == "ok"


def check(store: dict, load: dict) -> None:
    src = dict(zip(["long", "short"], store["prompts"]))
    dst = dict(zip(["long", "short", "control"], load["prompts"]))
    for name in ("long", "short"):
        a, b, pages = src[name], dst[name], HITS[name] // PAGE
        assert a["details"].get("storage", 0) == 0, (name, a["details"])
        assert b["details"].get("storage") == HITS[name], (name, b["details"], b["cached_tokens"])
        assert b["cached_tokens"] == HITS[name], (name, b["cached_tokens"])
        assert len(a["digests"]) >= pages and len(b["digests"]) >= pages, (name, a["matched_tokens"],
                                                                            b["matched_tokens"])
        bad = [i for i in range(pages) if a["digests"][i] != b["digests"][i]]
        assert not bad, f"{name}: {len(bad)} of {pages} loaded pages differ, first {bad[:4]}"
        assert b["token"] == a["token"] and top_diff(a["logprobs"], b["logprobs"]) <= LOGPROB_TOL
    control = dst["control"]
    assert control["cached_tokens"] == 0 and control["details"].get("storage", 0) == 0, control
    # the prefix moves the first token's distribution: the check above can fail
    assert top_diff(dst["long"]["logprobs"], control["logprobs"]) > 4 * LOGPROB_TOL
    c, hit_pages = load["backend"], (HITS["long"] + HITS["short"]) // PAGE
    assert c["loaded_pages"] == hit_pages and c["hit_pages"] >= hit_pages, c
    assert c["failed_loads"] == 0 and c["refused"] is None, c
    assert store["detached"]["ok"] and load["detached"]["ok"], (store["detached"], load["detached"])


def test_the_radix_cache_loads_what_another_stored_straight_into_the_gpu(model, start_daemon, tmp_path):
    daemon = start_daemon(gpu="on", chunk_tokens=CHUNK, host_capacity="1GiB",
                          client_timeout_s=30.0, heartbeat_interval_s=1.0)
    kvd = {"kvd_runtime_dir": str(daemon.runtime_dir), "kvd_timeout_s": 10.0}
    p, hit = prompts(), HITS["long"] + HITS["short"]
    a = finish(spawn(tmp_path, "store", {"model": str(model), "kvd": kvd, "page_size": PAGE,
                                         "cache": "radix", "prompts": [p["long"], p["short"]],
                                         "wait_stored_pages": hit // PAGE}))
    assert a["backend"]["stored_tokens"] >= hit and a["backend"]["refused"] is None, a["backend"]
    b = finish(spawn(tmp_path, "load", {"model": str(model), "kvd": kvd, "page_size": PAGE,
                                        "cache": "radix", "poison": 0.75,
                                        "prompts": [p["long"], p["short"], p["control"]]}))
    src, dst = dict(zip(["long", "short"], a["prompts"])), dict(zip(["long", "short", "control"], b["prompts"]))
    for name in ("long", "short"):
        pages = HITS[name] // PAGE
        bad = [i for i in range(pages) if src[name]["digests"][i] != dst[name]["digests"][i]]
        assert len(dst[name]["digests"]) >= pages and not bad, (name, dst[name]["matched_tokens"], bad[:4])
        assert dst[name]["token"] == src[name]["token"]
        assert top_diff(src[name]["logprobs"], dst[name]["logprobs"]) <= LOGPROB_TOL
    assert top_diff(dst["long"]["logprobs"], dst["control"]["logprobs"]) > 4 * LOGPROB_TOL
    c = b["backend"]
    assert c["loaded_tokens"] == hit and c["failed_loads"] == 0 and c["refused"] is None, c
    assert daemon.stats()["chunks_loaded"] == hit // CHUNK
    assert a["detached"]["ok"] and b["detached"]["ok"]
