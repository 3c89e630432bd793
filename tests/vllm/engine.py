"""A real vLLM engine for the connector's end-to-end tests (run with the vLLM venv's python).

    python engine.py SPEC.json OUT.json
        SPEC: {"model": DIR, "kvd": null | {extra config}, "multiprocess": bool,
               "phases": [{"prompts": [[token ids]], "freeze_daemon": pid | null,
                           "settle": bool}],
               "max_tokens": int, "max_model_len": int (2048), "kv_cache_dtype": str,
               "speculative": {config} | null,
               "kv_role": "kv_both" (default) | "kv_producer" (stores only) | "kv_consumer",
               "state_digests": bool (tests/vllm/engine_states.py; in-process engines)}
        OUT: per phase the greedy tokens, the chosen tokens' logprobs, each
        request's num_cached_tokens, and the deltas of vLLM's own counters
        (and with ``state_digests`` the digests of the state blocks stored and loaded)

The engine runs with prefix caching off (every hit is kvd's) and stats on.
With ``freeze_daemon`` the phase's first loads find the daemon frozen
(SIGSTOP, kvd_client.vllm's worker waits out its deadline and fails the
loads) and the daemon is thawed once they ended: vLLM must recompute. With ``settle``
(in-process engines) the phase ends once every store the worker submitted has ended, so
the next phase's lookups find what it stored. The model is tests/vllm/tiny_llama.py's.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import traceback

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
              max_model_len=spec.get("max_model_len", 2048), max_num_batched_tokens=2048,
              max_num_seqs=8,
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
        name, module = ("FaultyKvdConnector", "engine_faults") if faulty else \
            ("StateDigestKvdConnector", "engine_states") if spec.get("state_digests") else \
            ("KvdConnector", "kvd_client.vllm")
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=name, kv_connector_module_path=module,
            kv_role=spec.get("kv_role", "kv_both"), kv_connector_extra_config=spec["kvd"])
    llm = LLM(**kw)
    inproc = type(llm.llm_engine.engine_core).__name__ == "InprocClient"
    assert inproc != bool(spec.get("multiprocess")), f"asked multiprocess={spec.get('multiprocess')}"
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
        if spec.get("state_digests"):
            import engine_states
            phases[-1]["state_digests"] = engine_states.take()
        if phase.get("settle"):
            settle_stores()
    llm.llm_engine.engine_core.shutdown()
    return {"phases": phases}


def settle_stores(timeout: float = 60.0) -> None:
    """Every store the in-process worker submitted has ended (stores end on their own, after
    the steps that submitted them: on a loaded machine, after the phase's last step)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    for t in [t for stores in worker.open_stores.values() for t in stores]:
        t.wait(timeout)


def run_files(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        result = run(json.load(f))
    with open(out_path, "w") as f:
        json.dump(result, f)


def serve() -> None:
    from vllm import LLM, SamplingParams  # noqa: F401 - imported once, before the forks
    from vllm.config import KVTransferConfig  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(job)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(job: dict) -> None:
    """One job in the forked child, as ``python engine.py SPEC OUT`` would run it; never returns."""
    code = 1
    try:
        null, log = os.open(os.devnull, os.O_RDONLY), os.open(job["log"], os.O_WRONLY | os.O_CREAT
                                                              | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.environ.update(job["env"])
        run_files(job["spec"], job["out"])
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter's exit would run
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["serve"] else run_files(sys.argv[1], sys.argv[2])
