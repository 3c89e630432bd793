"""Model classes beyond dense attention through real vLLM on a GPU: sliding-window hybrids, MLA.

Runs as tests/vllm/test_gpu_engine.py does (a daemon with ``--gpu on`` and
engines in processes of their own, random-weight checkpoints written at test
time, every KV byte of a loading engine poisoned first); skipped without a
CUDA GPU and a GPU build of vLLM.

- **Sliding-window hybrid** (Llama with ``layer_types`` alternating sliding
  and full attention). Where vLLM takes load failures per request (0.32),
  vLLM keeps its hybrid KV cache manager on (two KV cache groups), each
  group has its own namespace, the full-attention layers load every hit
  chunk and the sliding ones only the chunk of the window before the hit.
  Elsewhere (0.26) vLLM turns the manager off and every layer loads every
  hit chunk. The first token's logprobs with the poisoned engine prove that
  every block attention reads was loaded.
- **MLA** (DeepSeek-V2-shaped): the latent blocks vLLM's MLA backend picks
  (64 tokens) load byte-identical to the storing engine's, across the two
  model runners.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_gpu_engine import (ASYNC_MIN, CHUNK, HITS, LOGPROB_TOL, MODEL, check_pair, finish,
                             prompts, spawn)
from engine_procs import top_diff
import tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.timeout(1500)]
WINDOW = 128            # under one kvd chunk: each hit loads one chunk of the sliding layers
TOKEN_LAYER_BYTES = 2 * MODEL["num_key_value_heads"] * MODEL["head_dim"] * 2  # K and V, bf16


def vllm_takes_failures_per_request() -> bool:
    """vLLM 0.32's KVConnectorTransferResults, without importing vLLM (30 s)."""
    base = Path(importlib.util.find_spec("vllm").origin).parent / \
        "distributed/kv_transfer/kv_connector/v1/base.py"
    return "class KVConnectorTransferResults" in base.read_text()


def daemon_and_settings(start_daemon) -> tuple:
    daemon = start_daemon(gpu="on", chunk_tokens=CHUNK, host_capacity="1GiB",
                          client_timeout_s=30.0, heartbeat_interval_s=1.0)
    return daemon, {"runtime_dir": str(daemon.runtime_dir), "timeout_s": 10.0,
                    "async_load_min_tokens": ASYNC_MIN, "partial_tails": False}  # HITS: whole chunks


def store_then_load(tmp_path, model, kvd: dict, name: str) -> tuple[dict, dict]:
    """Engine A (V2 runner) computes and stores the long and short prompts; a fresh,
    poisoned engine B (V1 runner) serves them and the control."""
    p = prompts(name)

    def spec(batches: list, poison=None) -> dict:
        return {"model": str(model), "kvd": kvd, "poison": poison, "batches": [[p[b]] for b in batches]}
    (store,) = finish([spawn(tmp_path, f"store-{name}", spec(["long", "short"]), "v2")])
    (load,) = finish([spawn(tmp_path, f"load-{name}", spec(["long", "short", "control"], 0.75), "v1")])
    return store, load


def test_a_sliding_window_hybrid_keeps_vllms_hybrid_manager(start_daemon, tmp_path,
                                                            tmp_path_factory):
    config = {**MODEL, "sliding_window": WINDOW,
              "layer_types": ["sliding_attention", "full_attention"] * 2}
    model = tiny_llama.write(tmp_path_factory.mktemp("gpu-swa"), config=config, std=0.05)
    daemon, kvd = daemon_and_settings(start_daemon)
    store, load = store_then_load(tmp_path, model, kvd, "swa")
    hybrid = vllm_takes_failures_per_request()
    assert store["groups"] == load["groups"] == (2 if hybrid else 1), (store["groups"], load["groups"])
    log = (tmp_path / "load-swa.log").read_text()
    assert ("Turning off hybrid kv cache manager" in log) is not hybrid
    assert ("group=full:" in log and f"group=swa{WINDOW}:" in log) is hybrid
    src, dst = store["prompts"], load["prompts"]
    for a, b, name in zip(src, dst, ("long", "short")):
        assert b["num_cached_tokens"] == HITS[name], (name, b["num_cached_tokens"])
        assert b["token"] == a["token"] and top_diff(a["logprobs"], b["logprobs"]) <= LOGPROB_TOL
    assert dst[2]["num_cached_tokens"] == 0
    assert top_diff(dst[0]["logprobs"], dst[2]["logprobs"]) > 4 * LOGPROB_TOL
    c, hits = load["counters"], HITS["long"] + HITS["short"]
    assert c["vllm:kvd_hit_tokens"] == hits and "vllm:kvd_load_failures" not in c, c
    # two full-attention layers load every hit token, two sliding ones one chunk per hit
    # (with the hybrid manager off: every layer every token)
    loaded = (hits + 2 * CHUNK) * 2 if hybrid else hits * 4
    assert c["vllm:kvd_loaded_bytes"] == loaded * TOKEN_LAYER_BYTES, c
    assert daemon.proc.poll() is None


def test_mla_latent_blocks_load_byte_exact(start_daemon, tmp_path, tmp_path_factory):
    model = tiny_llama.write(tmp_path_factory.mktemp("gpu-mla"), config=tiny_llama.DEEPSEEK,
                             std=0.05)
    daemon, kvd = daemon_and_settings(start_daemon)
    store, load = store_then_load(tmp_path, model, kvd, "mla")
    assert "'attention': 'mla'" in (tmp_path / "load-mla.log").read_text()
    check_pair(store, load)
    # one latent row of 576 bf16 per token and layer
    assert load["counters"]["vllm:kvd_loaded_bytes"] == (HITS["long"] + HITS["short"]) * 4 * 576 * 2
    assert daemon.stats()["chunks_loaded"] == (HITS["long"] + HITS["short"]) // CHUNK
