"""Real vLLM on a GPU: kvd's hits end on vLLM's blocks, not on kvd's 256-token chunks.

Needs a CUDA GPU and a GPU build of vLLM in this python (skipped otherwise, as
test_gpu_engine.py, whose engines (tests/vllm/gpu_engine.py: one process each,
first token's logprobs, SHA-256 of every KV block) it uses). One engine (V2
runner) computes a 2,048-token prompt (8 whole chunks), then a first turn of
600 tokens, then an unrelated prompt, whose step stores the first turn's tail
(88 computed tokens past its 2 chunks, kept as a partial entry cut to a
block). A fresh engine (V1 runner, every KV byte poisoned) then serves (the
figures for vLLM 0.26's 16-token blocks; 0.34 has 64):

- the 2,048-token prompt: a hit of 2,032 tokens (all but the last block; whole
  chunks would give 1,792), loaded between steps, its last chunk in part:
  the first token as the storer's, the 127 loaded blocks byte-identical;
- the second turn (the first turn, its answer and 200 more tokens): a hit of
  592 tokens (2 chunks and the 80-token tail), loaded inside the step, its 37
  blocks byte-identical to the first turn's;

and the connector's counters say so (hits, loads, recomputed tokens).
"""

from __future__ import annotations

import pytest
from engine_procs import top_diff
from test_gpu_engine import LOGPROB_TOL, MODEL, finish, same_first_token, spawn, tokens
import tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = 256
LONG = tokens("blocks/long", 2048)
TURN1 = tokens("blocks/turn1", 600)
FLUSH = tokens("blocks/flush", 40)


def hits(block: int) -> tuple[int, int]:
    """The long prompt's hit (all but its last block) and the second turn's (2 chunks and the
    first turn's tail cut to a block), for the engines' block size."""
    return len(LONG) - block, 2 * CHUNK + (len(TURN1) - 2 * CHUNK) // block * block


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama.write(tmp_path_factory.mktemp("gpu-blocks"), config=MODEL, std=0.05)


def test_hits_end_on_blocks_and_reach_the_previous_turns_tail(model, start_daemon, tmp_path):
    daemon = start_daemon(gpu="on", chunk_tokens=CHUNK, host_capacity="1GiB",
                          client_timeout_s=30.0, heartbeat_interval_s=1.0)
    kvd = {"runtime_dir": str(daemon.runtime_dir), "timeout_s": 10.0,
           "async_load_min_tokens": 1024}  # the 2,032-token hit between steps, 592 in the step

    def spec(batches: list, poison=None) -> dict:
        return {"model": str(model), "kvd": kvd, "poison": poison, "batches": batches}
    (store,) = finish([spawn(tmp_path, "store-blocks", spec([[LONG], [TURN1], [FLUSH]]), "v2")])
    long_a, turn1, _ = store["prompts"]
    block = store["block_size"]
    hit_long, hit_turn2 = hits(block)
    turn2 = TURN1 + [turn1["token"]] + tokens("blocks/turn2", 200)
    assert daemon.stats()["tiers"]["host"]["entries"] == 8 + 2 + 1  # chunks, and turn 1's tail

    (load,) = finish([spawn(tmp_path, "load-blocks", spec([[LONG], [turn2]], poison=0.75), "v1")])
    assert load["block_size"] == block, (load["block_size"], block)
    long_b, turn2_b = load["prompts"]
    assert long_b["num_cached_tokens"] == hit_long
    assert long_b["digests"][:hit_long // block] == long_a["digests"][:hit_long // block]
    assert same_first_token(long_a, long_b) and top_diff(long_a["logprobs"], long_b["logprobs"]) \
        <= LOGPROB_TOL
    assert turn2_b["num_cached_tokens"] == hit_turn2
    assert turn2_b["digests"][:hit_turn2 // block] == turn1["digests"][:hit_turn2 // block]
    c, hit = load["counters"], hit_long + hit_turn2
    assert c["vllm:kvd_hit_tokens"] == hit and c["vllm:kvd_loaded_tokens"] == hit, c
    assert c["vllm:prompt_tokens_by_source{source=external_kv_transfer}"] == hit, c
    assert c["vllm:kvd_loads"] == 3 and "vllm:kvd_load_failures" not in c, c  # turn 2: 2 loads
    assert c["vllm:kvd_recomputed_tokens"] == block + len(turn2) - hit_turn2, c
    assert daemon.proc.poll() is None and daemon.control("health")["status"] == "ok"
