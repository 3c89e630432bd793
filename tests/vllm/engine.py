"""A real vLLM engine for the connector's end-to-end tests (run with the vLLM venv's python).

    python engine.py run SPEC.json OUT.json
        SPEC: {"model": DIR, "kvd": null | {extra config}, "multiprocess": bool,
               "phases": [{"prompts": [[token ids]], "freeze_daemon": pid | null}],
               "max_tokens": int, "kv_cache_dtype": str, "speculative": {config} | null,
               "kv_role": "kv_both" (default) | "kv_producer" (stores only) | "kv_consumer"}
        OUT: per phase the greedy tokens, the chosen tokens' logprobs, each
        request's num_cached_tokens, and the deltas of vLLM's own counters

The engine runs with prefix caching off (every hit is kvd's) and stats on.
With ``freeze_daemon`` the phase's first loads find the daemon frozen
(SIGSTOP, kvd_client.vllm's worker waits out its deadline and fails the
loads) and the daemon is thawed once they ended: vLLM must recompute. The model is
tests/vllm/tiny_llama.py's.
"""

from __future__ import annotations

import json
import sys

BLOCK_SIZE = 32
COUNTERS = ("vllm:prompt_tokens_by_source", "vllm:prompt_tokens", "vllm:external_prefix_cache_hits",
            "vllm:external_prefix_cache_queries", "vllm:kvd_")


def snapshot(llm) -> dict[str, float]:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith(COUNTERS) and hasattr(m, "value"):
            labels = {k: v for k, v in m.labels.items() if k not in ("model_name", "engine")}
            key = m.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
            out[key] = out.get(key, 0) + m.value
    return out


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = dict(model=spec["model"], load_format="safetensors", dtype="bfloat16", seed=0,
              max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=8,
              block_size=BLOCK_SIZE, enforce_eager=True, enable_prefix_caching=False,
              skip_tokenizer_init=True, disable_log_stats=False, kv_cache_memory_bytes=64 << 20)
    if not spec.get("multiprocess"):
        kw["distributed_executor_backend"] = "uni"
    if spec.get("kv_cache_dtype"):
        kw["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("speculative"):
        kw["speculative_config"] = spec["speculative"]
    if spec.get("tp", 1) > 1:
        kw["tensor_parallel_size"] = spec["tp"]
    if spec.get("kvd") is not None:
        faulty = any(p.get("freeze_daemon") for p in spec["phases"])
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="FaultyKvdConnector" if faulty else "KvdConnector",
            kv_connector_module_path="engine_faults" if faulty else "kvd_client.vllm",
            kv_role=spec.get("kv_role", "kv_both"), kv_connector_extra_config=spec["kvd"])
    llm = LLM(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 12), ignore_eos=True,
                            detokenize=False, logprobs=0)
    phases = []
    for phase in spec["phases"]:
        if phase.get("freeze_daemon"):
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            connector = get_kv_transfer_group()
            connector.freeze_pid = phase["freeze_daemon"]
            type(connector).armed = True
        before = snapshot(llm)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]], params,
                            use_tqdm=False)
        after = snapshot(llm)
        phases.append({
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[round(lp[t].logprob, 4) for lp, t in zip(o.outputs[0].logprobs,
                                                                    o.outputs[0].token_ids)]
                         for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
            "finish_reasons": [o.outputs[0].finish_reason for o in outs],
            "counters": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)},
        })
    llm.llm_engine.engine_core.shutdown()
    return {"phases": phases}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = run(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
