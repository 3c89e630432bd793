"""A real SGLang engine on a GPU with kvd's HiCache backend, for tests/sglang/test_gpu_server.py.

    python gpu_server.py SPEC.json OUT.json
        SPEC: {"model": DIR, "kvd": {kvd_* options}, "page_size": int, "poison": float | null,
               "prompts": [[token ids], ...], "wait_stored_pages": int | null,
               "max_total_tokens": int, "engine": {more sglang.Engine arguments}}
        OUT: per prompt the first token and its top logprobs, SGLang's cached token
        counts (``cached_tokens``, ``cached_tokens_details``: device / host / storage),
        the SHA-256 of each of its pages in the GPU KV pool (every layer's K and V,
        read right after the request); the kvd backend's counters at the end

One ``sglang.Engine`` (its scheduler in a process of its own) with the
hierarchical cache on and kvd as its storage tier through SGLang's
``dynamic`` backend (``module_path`` ``sglang_probe``: kvd's backend plus a
probe, tests/sglang/sglang_probe.py). Prompts run one at a time, greedy,
one new token. Prefetch waits for the whole storage hit
(``wait_complete``), so a hit is always loaded, never recomputed. Attention
is SGLang's triton backend and sampling its pytorch one: neither needs
FlashAttention 3 or flashinfer's JIT, which the staged SGLang lacks
(docs/sglang.md). With ``poison`` every KV byte (GPU and host pools) is set
to that value first: a page kvd should have loaded and did not keeps it.
``wait_stored_pages``: before exiting, wait (60 s at most) until the backend
stored that many pages (SGLang backs up to storage after the request ends).
At the end SGLang detaches the backend, which closes it (the scheduler
process is killed at shutdown, and would leave its staging pool behind).
``"cache": "radix"``: kvd's radix cache instead of HiCache (``--radix-cache-backend
kvd``, the ``kvd_*`` options in the same extra config; kvd-cache's plugin entry
point offered by a dist-info on PYTHONPATH), stores when a request ends.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

TOP_LOGPROBS = 20


def engine_args(spec: dict) -> dict:
    common = {"model_path": spec["model"], "dtype": "bfloat16", "skip_tokenizer_init": True,
              "page_size": spec.get("page_size", 64), "attention_backend": "triton",
              "sampling_backend": "pytorch", "disable_cuda_graph": True, "grammar_backend": "none",
              "random_seed": 0, "max_total_tokens": spec.get("max_total_tokens", 32768),
              "mem_fraction_static": 0.6, "log_level": "info"}
    if spec.get("cache") == "radix":  # kvd's radix cache: straight into the GPU pool
        return {**common, "radix_cache_backend": "kvd",
                "hicache_storage_backend_extra_config": json.dumps(spec["kvd"]), **spec.get("engine", {})}
    extra = {"backend_name": "kvd", "module_path": "sglang_probe", "class_name": "KvdHiCacheStorage",
             "interface_v1": 1, **spec["kvd"]}
    return {**common, "enable_hierarchical_cache": True, "hicache_ratio": 2.0,
            "hicache_write_policy": "write_through", "hicache_storage_backend": "dynamic",
            "hicache_storage_prefetch_policy": "wait_complete",
            "hicache_storage_backend_extra_config": json.dumps(extra), **spec.get("engine", {})}


def offer_plugins() -> str:
    """kvd-cache's ``sglang.srt.plugins`` entry point, and the probe's, for SGLang's processes:
    a dist-info in a folder put first on PYTHONPATH (kvd_client.sglang.plugin.offer)."""
    from kvd_client.sglang import plugin

    site = plugin.offer(tempfile.mkdtemp(prefix="kvd-sgl-plugins-"), {"kvd_probe": "sglang_probe:install"})
    os.environ["PYTHONPATH"] = os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, site)
    return site


class Probe:
    """kvd_probe in the engine's scheduler process (tests/sglang/sglang_probe.py)."""

    def __init__(self, engine):
        self.engine, self.dir = engine, tempfile.mkdtemp(prefix="kvd-sgl-probe-")

    def __call__(self, op: str, **args):
        path = os.path.join(self.dir, op + ".json")
        with open(path + ".in", "w") as f:
            json.dump(args, f)
        self.engine.collective_rpc("kvd_probe", path=path, op=op)
        with open(path) as f:
            return json.load(f)

    def close(self):
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


def top_logprobs(meta: dict) -> dict[str, float]:
    """The first new token's top logprobs as {token id: logprob}."""
    first = meta["output_top_logprobs"][0]
    return {str(entry[1]): float(entry[0]) for entry in first}


def run_prompt(engine, probe, tokens: list[int]) -> dict:
    out = engine.generate(input_ids=tokens, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                          return_logprob=True, top_logprobs_num=TOP_LOGPROBS)
    meta = out["meta_info"]
    pages = probe("digests", tokens=tokens)
    return {"token": out["output_ids"][0], "logprobs": top_logprobs(meta),
            "cached_tokens": meta.get("cached_tokens", 0),
            "details": meta.get("cached_tokens_details") or {}, **pages}


def wait_stored(probe, pages: int, page_size: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = probe("stats")  # the radix cache counts tokens, the backend pages
        stored = stats.get("stored_pages", stats.get("stored_tokens", 0) // page_size)
        if stored >= pages or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def run(spec: dict) -> dict:
    import sglang

    site = offer_plugins() if spec.get("cache") == "radix" else None
    engine = sglang.Engine(**engine_args(spec))
    probe = Probe(engine)
    try:
        if spec.get("poison") is not None:
            probe("poison", value=spec["poison"])
        results = [run_prompt(engine, probe, p) for p in spec["prompts"]]
        if spec.get("wait_stored_pages"):
            stats = wait_stored(probe, spec["wait_stored_pages"], spec.get("page_size", 64))
        else:
            stats = probe("stats")
        detached = probe("detach")  # the backend closes: its staging pool leaves /dev/shm
        return {"prompts": results, "backend": stats, "detached": detached, "sglang": sglang.__version__}
    finally:
        probe.close()
        engine.shutdown()
        if site is not None:
            shutil.rmtree(site, ignore_errors=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = run(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
