"""The connector's options, read from vLLM's ``kv_connector_extra_config``.

``Settings.from_extra(extra)`` validates the free-form dict vLLM passes
through: every key must be one of ``OPTIONS`` (a typo raises ``ValueError``
naming the known keys), every value must have the option's type. Each
option has a type, a default and help text; ``Settings`` has one field per
option and docs/vllm.md lists the same options (tests check both). No vLLM
import: plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd_client.adapter_options import Option, checked

STORE_POLICIES = ("all", "finish", "off")
FAILURE_POLICIES = ("recompute", "fail")
BLOCK_FORMATS = ("blocks", "rows")
SHARING = ("auto", "fd", "legacy_ipc")


OPTIONS = {
    "runtime_dir": Option(str, "", "the kvd daemon's runtime directory; empty: kvd's own resolution "
                          "($KVD_RUNTIME_DIR, $XDG_RUNTIME_DIR/kvd, /run/kvd, /tmp/kvd-<uid>)"),
    "model_id": Option(str, "", "the model identity in chunk keys; empty: vLLM's model name or path, "
                       "plus '@revision' when one is set. Engines that should share chunks must agree"),
    "timeout_s": Option(float, 5.0, "deadline of each kvd call and transfer, seconds; a load that misses "
                        "it fails and vLLM recomputes; a lookup unanswered by then is a miss"),
    "lookup_wait_ms": Option(float, 2.0, "how long the scheduler may wait for lookup replies in one "
                             "step, all requests together; a request whose reply is not there yet "
                             "is skipped this step (vLLM asks again the next), so a slow or hung "
                             "daemon never stalls a step longer"),
    "lease_ms": Option(int, 10000, "how long a lookup's hits stay pinned in kvd for the load that "
                       "follows (the scheduler releases the lease earlier when it can)"),
    "salt": Option(str, "", "a fixed salt in every key (a tenant or deployment): engines with other "
                   "salts never share chunks"),
    "salt_per_request": Option(bool, True, "add the request's cache_salt (vLLM's per-request salt) "
                               "to its keys"),
    "salt_lora": Option(bool, True, "add the LoRA adapter's name to the keys of its requests"),
    "store_policy": Option(str, "all", "when KV goes to kvd: 'all' (every whole chunk in the step that "
                           "computed it, prefill and decode), 'finish' (once, when the request ends; "
                           "needs one more engine step) or 'off' (lookups and loads only)",
                           STORE_POLICIES),
    "store_min_tokens": Option(int, 0, "requests with fewer prompt tokens are not stored"),
    "partial_tails": Option(bool, True, "keep a request's tail past its last whole chunk (cut to a "
                            "block) as a partial entry when it ends, and its prompt's own tail where "
                            "the answer reached past the prompt's last block; look partial entries up "
                            "where a whole-chunk hit stops (one full-attention KV cache group only)"),
    "async_load_min_tokens": Option(int, 65536, "a hit of at least this many tokens loads "
                                    "asynchronously, between steps (the request waits outside the "
                                    "batch, other requests' steps are not stretched by its copy); "
                                    "smaller hits load layer by layer inside the step, overlapped "
                                    "with the forward (the lowest TTFT); 0: always asynchronous"),
    "load_failure_policy": Option(str, "recompute", "vLLM's kv_load_failure_policy that the connector "
                                  "sets: 'recompute' (a failed load is recomputed) or 'fail' (the "
                                  "request ends with an error)", FAILURE_POLICIES),
    "retry_failed_after_s": Option(float, 30.0, "keys whose load failed are not offered again for "
                                   "this long (a failed hit offered again would loop)"),
    "gpu_block_format": Option(str, "blocks", "how kvd keeps a GPU engine's (non-MLA) KV blocks: "
                               "'blocks' (whole vLLM blocks, moved by the GPU's copy engines with no "
                               "kernel of kvd's on the engine's GPU; shared with vLLM GPU engines of "
                               "the same model, block size and block layout) or 'rows' (token rows, "
                               "shared with SGLang and any engine of the model, but moved by kvd's "
                               "SM kernels, which cost the engine GPU time while they run)",
                               BLOCK_FORMATS),
    "kv_cache_sharing": Option(str, "auto", "vLLM 0.34 on a GPU: how the workers share the KV cache "
                               "with kvd: 'fd' (vLLM's extensible, virtual-memory KV cache, lent "
                               "to kvd by file descriptor), 'legacy_ipc' (vLLM turns the "
                               "extensible cache off; CUDA IPC, as with earlier vLLM) or 'auto' "
                               "('fd' when the daemon serves it: its fds.sock exists when vLLM "
                               "starts; set 'fd' where the engine may start first). With "
                               "num_gpu_blocks_override or kv_cache_memory_bytes vLLM cannot use "
                               "the extensible cache: set 'legacy_ipc'", SHARING),
    "shm_dir": Option(str, "/dev/shm", "CPU engines: where the KV cache file goes (the daemon's "
                      "shm_dir; must hold the whole KV cache)"),
}


@dataclass(frozen=True)
class Settings:
    runtime_dir: str = ""
    model_id: str = ""
    timeout_s: float = 5.0
    lookup_wait_ms: float = 2.0
    lease_ms: int = 10000
    salt: str = ""
    salt_per_request: bool = True
    salt_lora: bool = True
    store_policy: str = "all"
    store_min_tokens: int = 0
    partial_tails: bool = True
    async_load_min_tokens: int = 65536
    load_failure_policy: str = "recompute"
    retry_failed_after_s: float = 30.0
    gpu_block_format: str = "blocks"
    kv_cache_sharing: str = "auto"
    shm_dir: str = "/dev/shm"

    @classmethod
    def from_extra(cls, extra: dict | None) -> Settings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(OPTIONS))
        if unknown:
            raise ValueError(f"kvd connector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {', '.join(OPTIONS)}")
        values = {}
        for name, opt in OPTIONS.items():
            value = extra.get(name, opt.default)
            values[name] = checked(f"kvd connector: {name}", opt, value)
        return cls(**values)
