"""Real vLLM on a GPU with kvd's connector: KV bytes, logprobs and counters across engines.

Needs a CUDA GPU and a GPU build of vLLM importable by this python (skipped
otherwise, e.g. in CI); ``kvd serve --gpu on`` and every engine run as
processes of their own (tests/vllm/gpu_engine.py). The model is a 4-layer
Llama written at test time with seeded random weights (FlashAttention's head
size 128), so logits depend on the prefix, unlike vLLM's dummy weights.

Two storing engines run side by side (one after the other where vLLM sizes its KV cache
from measured memory: 0.34's extensible cache), one on each of vLLM's model runners,
each on its own prompts and in one of the connector's ``gpu_block_format``s
(whole blocks, token rows); then two fresh loading engines, each on the
other runner than the engine that stored its prompts (same block format),
with every KV byte poisoned first. For each prompt (one hit loaded between steps, one layer by layer
inside the step):

- the loader's KV blocks of the hit tokens are byte-identical to the storer's
  (SHA-256 of each block over every layer, read right after each request);
- the first token's top logprobs agree within bf16 noise, while a control
  prompt that differs only in its prefix (no hit) gives other logprobs;
- the connector's counters, vLLM's prompt tokens by source and the daemon's
  counters agree on the hit.

With ``verify_loads = on``, a byte flipped in the daemon's host tier is
caught: the load stops before that chunk and vLLM recomputes the rest.
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
from daemons import wait_for
from engine_procs import top_diff
import pytest
from shm_files import flip_chunk
import tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.timeout(1500)]
if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("no GPU build of vLLM in this python (tests/vllm/test_engine.py runs the CPU "
                "build)", allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHUNK = 256                     # kvd chunk; vLLM's GPU block is each engine's block_size
ASYNC_MIN = 768                 # the 1024-token hit loads between steps, the 512 one per layer
MODEL = {**tiny_llama.CONFIG, "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 128}
LOGPROB_TOL = 0.05              # bf16 noise between a batch computed and one partly loaded


def tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, MODEL["vocab_size"]) for _ in range(n)]


def prompts(name: str) -> dict[str, list[int]]:
    """Two prompts with whole-chunk prefixes (hits of 1024 and 512 tokens) and the first's
    control: another prefix of the same length, the same suffix."""
    suffix = tokens(f"{name}/suffix", 40)
    return {"long": tokens(f"{name}/long", 1024) + suffix,
            "short": tokens(f"{name}/short", 512) + tokens(f"{name}/suffix2", 40),
            "control": tokens(f"{name}/control", 1024) + suffix}


HITS = {"long": 1024, "short": 512, "control": 0}


# vLLM 0.34 removed the first model runner (and refuses VLLM_USE_V2_MODEL_RUNNER=0): there the
# "v1" engines run the second one too, and the tests still cover both block formats
HAS_V1_RUNNER = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def spawn(tmp: Path, name: str, spec: dict, runner: str, env: dict | None = None) -> tuple:
    env = {**os.environ, **(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "clients"),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if HAS_V1_RUNNER:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    spec_path, out, log = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, str(HERE / "gpu_engine.py"), str(spec_path), str(out)],
                            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    return proc, out, log


def finish(runs: list) -> list[dict]:
    return [engine_procs.result(run, 900) for run in runs]


def run_engines(tmp: Path, jobs: list[tuple]) -> list[dict]:
    """``jobs`` of (name, spec, runner): side by side where vLLM's KV cache has the size the
    spec gives; one after another where vLLM sizes it from the GPU's free memory (0.34's
    extensible cache), which another engine starting or exiting beside it would change: vLLM
    would count that engine's memory as its own, or stop ("Error in memory profiling")."""
    from gpu_engine import extensible_kv_cache

    if extensible_kv_cache(jobs[0][1]["kvd"]):
        return [finish([spawn(tmp, *job)])[0] for job in jobs]
    return finish([spawn(tmp, *job) for job in jobs])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama.write(tmp_path_factory.mktemp("gpu-llama"), config=MODEL, std=0.05)


def test_engines_on_both_runners_share_kv_byte_for_byte(model, start_daemon, tmp_path):
    # copy engines wherever pages are byte ranges (whole blocks; this model's 16 KiB blocks are
    # under auto's gpu_dma_min_piece), SM kernels for token rows
    daemon = start_daemon(gpu="on", chunk_tokens=CHUNK, host_capacity="1GiB", gpu_copy_path="dma",
                          client_timeout_s=30.0, heartbeat_interval_s=1.0)
    kvd = {"runtime_dir": str(daemon.runtime_dir), "timeout_s": 10.0, "async_load_min_tokens": ASYNC_MIN,
           "partial_tails": False}  # hits of whole chunks (HITS)
    sets = {"v2": prompts("stored-by-v2"), "v1": prompts("stored-by-v1")}
    formats = {"v2": "blocks", "v1": "rows"}  # each set in one gpu_block_format, both covered

    def spec(r: str, batches: list, poison=None) -> dict:
        return {"model": str(model), "kvd": {**kvd, "gpu_block_format": formats[r]},
                "poison": poison, "batches": [[sets[r][name]] for name in batches]}

    stored = run_engines(tmp_path, [(f"store-{r}", spec(r, ["long", "short"]), r) for r in ("v2", "v1")])
    # the last store ends after the engine's last step (counted by the daemon, not by vLLM)
    assert daemon.stats()["chunks_stored"] == 2 * (1024 + 512) // CHUNK

    other = {"v2": "v1", "v1": "v2"}  # a set stored by one runner is loaded by the other
    loaded = run_engines(tmp_path, [(f"load-{other[r]}", spec(r, ["long", "short", "control"], poison=0.75),
                                     other[r]) for r in ("v2", "v1")])
    for store, load in zip(stored, loaded):
        check_pair(store, load)
    st = daemon.stats()
    assert st["chunks_loaded"] == 2 * (1024 + 512) // CHUNK, st
    assert daemon.proc.poll() is None and daemon.control("health")["status"] == "ok"
    assert daemon.log().count("copies by DMA") == 2, daemon.log()  # the two whole-block engines


def same_first_token(a: dict, b: dict) -> bool:
    """``b``'s first token is ``a``'s, or one ``a`` ranks tied with it within bf16 noise (random
    weights can put two tokens level: either may come out of a batch computed another way)."""
    top = max(a["logprobs"].values())
    return b["token"] == a["token"] or \
        a["logprobs"].get(str(b["token"]), float("-inf")) >= top - LOGPROB_TOL


def check_pair(store: dict, load: dict, counters: bool = True) -> None:
    """``load``'s hit blocks hold ``store``'s bytes, in blocks of the engines' own size (16
    tokens on 0.26's FlashAttention, 64 on 0.34's)."""
    block = load["block_size"]
    assert store["block_size"] == block, (store["block_size"], block)
    src = dict(zip(["long", "short"], store["prompts"]))
    dst = dict(zip(["long", "short", "control"], load["prompts"]))
    for name in ("long", "short"):
        a, b, hit_blocks = src[name], dst[name], HITS[name] // block
        assert b["num_cached_tokens"] == HITS[name], (name, b["num_cached_tokens"])
        # byte for byte: every hit block of the loader holds the storer's bytes
        bad = [i for i in range(hit_blocks) if a["digests"][i] != b["digests"][i]]
        assert not bad, f"{name}: {len(bad)} of {hit_blocks} loaded blocks differ, first {bad[:4]}"
        assert same_first_token(a, b) and top_diff(a["logprobs"], b["logprobs"]) <= LOGPROB_TOL
    control = dst["control"]
    assert control["num_cached_tokens"] == 0
    # the prefix moves the first token's distribution: the check above can fail
    assert top_diff(dst["long"]["logprobs"], control["logprobs"]) > 4 * LOGPROB_TOL
    if not counters:
        return
    c, hits = load["counters"], HITS["long"] + HITS["short"]
    assert c["vllm:kvd_hit_tokens"] == hits and c["vllm:kvd_loaded_tokens"] == hits, c
    assert c["vllm:prompt_tokens_by_source{source=external_kv_transfer}"] == hits, c
    assert c["vllm:kvd_lookups"] == 3 and c["vllm:kvd_loads"] == 2, c
    assert "vllm:kvd_load_failures" not in c, c
    # vLLM's own connector-cache counter misses steps without request outputs (its offline
    # LLM records no stats for them): at most the hit, never more
    assert c.get("vllm:external_prefix_cache_hits", 0) <= hits, c


def test_a_corrupt_host_chunk_is_recomputed_never_served(model, start_daemon, tmp_path):
    """``verify_loads = on``: a byte flipped in the host tier after the store ends the load
    before that chunk; vLLM recomputes the rest (the same first token), never reads it."""
    daemon = start_daemon(gpu="on", chunk_tokens=CHUNK, host_capacity="1GiB", gpu_copy_path="dma",
                          verify_loads="on", client_timeout_s=30.0, heartbeat_interval_s=1.0)
    # hits of whole chunks (HITS); CUDA IPC, where vLLM 0.34 would lend its extensible KV cache
    # by file descriptor (the test above): both ways of sharing run on 0.34
    kvd = {"runtime_dir": str(daemon.runtime_dir), "timeout_s": 10.0, "async_load_min_tokens": ASYNC_MIN,
           "partial_tails": False, "kv_cache_sharing": "legacy_ipc"}
    long = prompts("corrupt")["long"]

    def spec(poison=None) -> dict:
        return {"model": str(model), "kvd": kvd, "poison": poison, "batches": [[long]]}
    (store,) = finish([spawn(tmp_path, "store-c", spec(), "v2")])
    chunks, bad = HITS["long"] // CHUNK, 2

    def host() -> dict:
        return daemon.stats()["tiers"]["host"]["warm"]
    wait_for(lambda: host()["sealed_shards"] >= chunks and host()["unsealed_shards"] == 0, 10,
             "the checksums")
    flip_chunk(daemon.runtime_dir, bad)
    (load,) = finish([spawn(tmp_path, "load-c", spec(poison=0.75), "v1")])
    a, b = store["prompts"][0], load["prompts"][0]
    assert same_first_token(a, b) and top_diff(a["logprobs"], b["logprobs"]) <= LOGPROB_TOL
    good = bad * CHUNK // load["block_size"]  # the blocks before the corrupt chunk loaded exact
    assert b["digests"][:good] == a["digests"][:good]
    c = load["counters"]
    assert c["vllm:kvd_hit_tokens"] == HITS["long"] and c["vllm:kvd_load_failures"] == 1, c
    assert c["vllm:kvd_loaded_tokens"] == bad * CHUNK, c
    assert daemon.stats()["host_corrupt_dropped"] == 1
