"""Tensor parallelism through real vLLM on two GPUs: every rank stores and loads its shard.

Runs as tests/vllm/test_gpu_engine.py does (``kvd serve --gpu on``, engines
in processes of their own, random-weight checkpoints, loading engines
poisoned first); needs two CUDA GPUs and a GPU build of vLLM (skipped
otherwise). A TP=2 engine of a Llama (2 KV heads: one per rank) and one of a
DeepSeek-V2-shaped model (MLA) store the same prompts. Then, all at once:

- a fresh TP=2 Llama loads: each rank's hit blocks are byte-identical to
  the same rank's of the storing engine (each rank holds other heads);
- a TP=1 Llama gets no hit: its blocks hold both heads, other bytes than
  either shard (the TP size is part of the namespace);
- a fresh TP=2 and a TP=1 DeepSeek both load: MLA's latent rows are the same
  on every rank, kept once, so the TP=1 engine's blocks are byte-identical
  to rank 0's of the TP=2 engine that stored them.
"""

from __future__ import annotations

import pytest
from test_gpu_engine import HITS, MODEL, check_pair, finish, prompts, spawn
from test_gpu_models import daemon_and_settings
import tiny_llama

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.timeout(1500),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def test_tp2_ranks_store_and_load_their_shards_and_mla_shares_with_tp1(start_daemon, tmp_path,
                                                                       tmp_path_factory):
    llama = tiny_llama.write(tmp_path_factory.mktemp("tp-llama"), config=MODEL, std=0.05)
    mla = tiny_llama.write(tmp_path_factory.mktemp("tp-mla"), config=tiny_llama.DEEPSEEK, std=0.05)
    daemon, kvd = daemon_and_settings(start_daemon)
    p = prompts("tp")

    def spec(model, names: list, tp: int, poison=None) -> dict:
        return {"model": str(model), "kvd": kvd, "poison": poison, "tp": tp,
                "batches": [[p[n]] for n in names]}
    stored, all3 = ["long", "short"], ["long", "short", "control"]
    mha2, mla2 = finish([spawn(tmp_path, "store-mha-tp2", spec(llama, stored, 2), "v2"),
                         spawn(tmp_path, "store-mla-tp2", spec(mla, stored, 2), "v2")])
    mha2_load, mha1, mla2_load, mla1 = finish([
        spawn(tmp_path, "load-mha-tp2", spec(llama, all3, 2, 0.75), "v1"),
        spawn(tmp_path, "load-mha-tp1", spec(llama, ["long"], 1, 0.75), "v2"),
        spawn(tmp_path, "load-mla-tp2", spec(mla, all3, 2, 0.75), "v1"),
        spawn(tmp_path, "load-mla-tp1", spec(mla, all3, 1, 0.75), "v2")])

    # rank 0's blocks, logprobs, the control (the counters of several ranks are not checked here)
    check_pair(mha2, mha2_load, counters=False)
    for a, b, name in zip(mha2["prompts"], mha2_load["prompts"], stored):
        hit = HITS[name] // mha2_load["block_size"]
        assert [r[:hit] for r in b["rank_digests"]] == [r[:hit] for r in a["rank_digests"]], name
        assert a["rank_digests"][0][:hit] != a["rank_digests"][1][:hit]  # shards differ
    assert mha1["prompts"][0]["num_cached_tokens"] == 0  # another TP size: another namespace

    bs = mla2_load["block_size"]
    check_pair(mla2, mla2_load, counters=False)
    check_pair(mla2, mla1)  # TP=1 loads what TP=2 stored, byte for byte
    for a, name in zip(mla2["prompts"], stored):
        hit = HITS[name] // bs
        assert a["rank_digests"][0][:hit] == a["rank_digests"][1][:hit]  # one latent, every rank
    assert daemon.proc.poll() is None and daemon.control("health")["status"] == "ok"
