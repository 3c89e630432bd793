"""A real vLLM engine on a GPU for tests/vllm/test_gpu_engine.py (run in its own process).

    python gpu_engine.py SPEC.json OUT.json
        SPEC: {"model": DIR, "kvd": {extra config}, "runner": "v1" | "v2", "poison": float | null,
               "batches": [[[token ids], ...], ...], "kv_bytes": int, "tp": int (default 1)}
        OUT: per prompt the first token's top logprobs, the prompt's block ids and
        the SHA-256 of each block's bytes over every layer (read right after the
        batch that computed or loaded them), num_cached_tokens; the deltas of
        vLLM's and the connector's counters over the whole run; the block size
        vLLM chose (MLA backends pick 64) and the number of KV cache groups

The engine core and the worker run in this process (uni executor, no engine
process), so the recording connector below sees the block ids vLLM gives each
request and the worker extension reads the same engine's KV tensors. With
``tp`` > 1 the workers are processes of their own (mp executor), one per GPU;
``rank_digests`` then holds every rank's digests (``digests`` rank 0's). With
``poison`` every KV byte is set to that value before the first batch: a block
kvd should have loaded and did not keeps it. Prefix caching is off (every hit
is kvd's). ``runner`` picks vLLM's model runner (``VLLM_USE_V2_MODEL_RUNNER``; vLLM 0.34
has only the second). On vLLM 0.34 with ``kv_cache_sharing`` ``fd`` (the default with a CUDA
daemon) the KV cache is vLLM's extensible one, capped by ``gpu_util`` (``kv_bytes`` unused).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from engine import snapshot  # tests/vllm/engine.py: vLLM's and the connector's counters

from kvd_client.vllm.connector import KvdConnector

TOP_LOGPROBS = 20


class RecordingKvdConnector(KvdConnector):
    """The real connector; its scheduler half also keeps the block ids vLLM gave each
    request (at admission: every block of a prompt that fits one step; the first KV
    cache group's where there are several)."""

    blocks: dict[tuple, list[int]] = {}
    groups = 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        ids = blocks.get_block_ids()
        RecordingKvdConnector.groups = len(ids)
        RecordingKvdConnector.blocks[prompt_key(request.prompt_token_ids)] = list(ids[0])
        return super().update_state_after_alloc(request, blocks, num_external_tokens)


def prompt_key(tokens) -> tuple:
    return len(tokens), tuple(int(t) for t in tokens[:32])


class KVProbe:
    """vLLM worker extension: reads and poisons this worker's KV tensors."""

    def _kv_layers(self):
        blocks = self.vllm_config.cache_config.num_gpu_blocks
        return [(kv, _block_dim(kv, blocks)) for kv in self.model_runner.kv_caches]

    def poison_kv(self, value: float) -> int:
        for kv in self.model_runner.kv_caches:
            kv.fill_(value)
        import torch

        torch.cuda.synchronize()
        return len(self.model_runner.kv_caches)

    def block_digests(self, block_ids: list[int]) -> list[str]:
        import torch

        layers = self._kv_layers()
        out = []
        for b in block_ids:
            h = hashlib.sha256()
            for kv, dim in layers:
                h.update(kv.select(dim, b).contiguous().view(torch.uint8).cpu().numpy().tobytes())
            out.append(h.hexdigest())
        return out


def _block_dim(kv, num_blocks: int) -> int:
    dims = [i for i, s in enumerate(kv.shape) if s == num_blocks]
    if len(dims) != 1:
        raise RuntimeError(f"cannot tell the block dimension of a KV tensor {tuple(kv.shape)} "
                           f"({num_blocks} blocks)")
    return dims[0]


def extensible_kv_cache(kvd: dict) -> bool:
    """vLLM 0.34 lends kvd its extensible KV cache (``kv_cache_sharing`` ``fd``, what ``auto``
    picks with a CUDA daemon); earlier vLLM has no such cache."""
    import dataclasses

    from vllm.config import CacheConfig

    from kvd_client.vllm.access import sharing
    from kvd_client.vllm.settings import Settings

    fields = {f.name for f in dataclasses.fields(CacheConfig)}
    return "enable_extensible_kv_cache" in fields and sharing(Settings.from_extra(kvd)) == "fd"


def kv_cache_size(spec: dict) -> dict:
    """A fixed KV cache (``kv_bytes``) where vLLM allows one; the extensible cache sizes itself
    from measured memory and refuses ``kv_cache_memory_bytes``: there ``gpu_util`` caps it, low
    enough that the engines of a test fit side by side on one GPU."""
    if extensible_kv_cache(spec["kvd"]):
        return {"gpu_memory_utilization": spec.get("gpu_util", 0.15)}
    # gpu_memory_utilization is then only vLLM's free-memory check at start: below 0.9 so
    # that engines of tests run side by side on one GPU pass it
    return {"kv_cache_memory_bytes": spec.get("kv_bytes", 2 << 30),
            "gpu_memory_utilization": spec.get("gpu_util", 0.4)}


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], load_format="safetensors", dtype="bfloat16", seed=0,
              max_model_len=spec.get("max_model_len", 4096), enable_prefix_caching=False,
              skip_tokenizer_init=True, disable_log_stats=False, tensor_parallel_size=spec.get("tp", 1),
              **kv_cache_size(spec),
              distributed_executor_backend="uni" if spec.get("tp", 1) == 1 else "mp",
              worker_extension_cls="gpu_engine.KVProbe",
              kv_transfer_config=KVTransferConfig(
                  kv_connector="RecordingKvdConnector", kv_connector_module_path="gpu_engine",
                  kv_role="kv_both", kv_connector_extra_config=spec["kvd"]))
    if spec.get("poison") is not None:
        llm.collective_rpc("poison_kv", args=(spec["poison"],))
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, logprobs=TOP_LOGPROBS)
    before, results = snapshot(llm), []
    for batch in spec["batches"]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        for prompt, o in zip(batch, outs):
            blocks = RecordingKvdConnector.blocks.pop(prompt_key(prompt), None)
            if blocks is None:
                raise RuntimeError(f"no block ids recorded for a prompt of {len(prompt)} tokens; "
                                   f"recorded: {[k[0] for k in RecordingKvdConnector.blocks]}")
            ranks = llm.collective_rpc("block_digests", args=(blocks,))
            top = o.outputs[0].logprobs[0]
            results.append({"logprobs": {str(t): lp.logprob for t, lp in top.items()},
                            "token": o.outputs[0].token_ids[0], "blocks": blocks,
                            "digests": ranks[0], "rank_digests": ranks,
                            "num_cached_tokens": o.num_cached_tokens})
    after = snapshot(llm)
    counters = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    llm.llm_engine.engine_core.shutdown()
    vllm_config = llm.llm_engine.vllm_config
    return {"prompts": results, "counters": counters, "runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
            "block_size": vllm_config.cache_config.block_size, "groups": RecordingKvdConnector.groups}


if __name__ == "__main__":
    import gpu_engine  # the module vLLM loads the connector from, not this __main__ copy

    with open(sys.argv[1]) as f:
        result = gpu_engine.run(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
