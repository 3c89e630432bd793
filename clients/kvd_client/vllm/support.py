"""What kvd's vLLM connector refuses, and why: one function per check.

Each check takes ``(vllm_config, kv_cache_config, environ)`` and returns one line (setting,
why, what to do) or None; ``refusal`` returns the first, which the connector raises as
``ValueError`` before vLLM allocates its KV cache. Refused: pipeline/context parallelism,
sleep mode, cumem and expandable segments (served with 0.34's extensible cache instead),
quantised KV other than per-tensor fp8, run-time fp8 scales, mixed block sizes, layer kinds
other than full attention, MLA, sliding window and state, state groups outside their tested
conditions. Layouts and memory only the worker can check are refused there
(kvd_client.vllm.geometry, .pool). Nothing here imports vLLM.
"""

from __future__ import annotations

from . import layers
from .groups import is_state, state_kind

NO_KVD = "run without the kvd connector"
OR_NO_KVD = "or without the kvd connector"
CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
LAYER_KINDS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "MambaSpec")
QUANT_MODES = ("NONE", "FP8_PER_TENSOR")
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

WHY_KIND = {
    "ChunkedLocalAttentionSpec": "vLLM frees the blocks of past attention chunks",
    "CrossAttentionSpec": "encoder KV does not follow the prompt's tokens",
    "EncoderOnlyAttentionSpec": "encoder KV does not follow the prompt's tokens",
}


def _quant_why(name: str) -> str:
    if name.endswith("per_token_head"):
        return "its per-token, per-head scales live outside the blocks kvd moves"
    if name == "fp8_ds_mla":
        return "DeepSeek's packed MLA format, with scales inside the blocks"
    if name.startswith(("nvfp4", "turboquant", "ultraquant")):
        return "packed 4-bit values with block scales"
    return "a format kvd does not know"


# ---- the engine's settings ------------------------------------------------------------

def pipeline_parallel(vllm_config, kv_cache_config, environ) -> str | None:
    size = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1
    if size > 1:
        return (f"kvd: pipeline_parallel_size {size} is not supported (kvd's vLLM namespace has no "
                f"per-stage layer offset); use tensor parallelism or {NO_KVD}")
    return None


def context_parallel(vllm_config, kv_cache_config, environ) -> str | None:
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(vllm_config.parallel_config, name, 1) or 1
        if size > 1:
            return (f"kvd: {name} {size} is not supported (each rank's blocks hold tokens "
                    f"interleaved with other ranks', not the token runs kvd's chunks are); run "
                    f"without it {OR_NO_KVD}")
    return None


def extensible(vllm_config) -> bool:
    """vLLM 0.34's extensible KV cache is on: the KV memory lives outside PyTorch's allocator,
    kvd maps it by file descriptor and vLLM lends it out through the connector's hooks."""
    return getattr(vllm_config.cache_config, "enable_extensible_kv_cache", None) is True


def sleep_mode(vllm_config, kv_cache_config, environ) -> str | None:
    if getattr(vllm_config.model_config, "enable_sleep_mode", False) and not extensible(vllm_config):
        return ("kvd: enable_sleep_mode is not supported (sleep frees the KV cache kvd registered, "
                "and its allocator's memory cannot be shared through CUDA IPC); use vLLM 0.34's "
                "extensible KV cache (kv_cache_sharing 'fd'), run without sleep "
                f"mode {OR_NO_KVD}")
    return None


def cumem_allocator(vllm_config, kv_cache_config, environ) -> str | None:
    if getattr(vllm_config.model_config, "enable_cumem_allocator", False) and not extensible(vllm_config):
        return ("kvd: enable_cumem_allocator is not supported (CUDA virtual memory cannot be "
                f"shared with kvd through CUDA IPC); use vLLM 0.34's extensible KV cache, run without "
                f"it {OR_NO_KVD}")
    return None


def expandable_segments(vllm_config, kv_cache_config, environ) -> str | None:
    if vllm_config.device_config.device_type == "cpu" or extensible(vllm_config):
        return None  # the KV cache lives in the connector's /dev/shm file, or outside PyTorch's
    for var in ALLOC_CONF:
        for item in environ.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return (f"kvd: {var} sets expandable_segments:True, which is not supported (the KV "
                        "cache then lives in CUDA virtual memory that CUDA IPC cannot share with "
                        f"kvd); unset it for the engine or {NO_KVD}")
    return None


def cache_dtype(vllm_config, kv_cache_config, environ) -> str | None:
    name = str(vllm_config.cache_config.cache_dtype)
    if name in CACHE_DTYPES:
        return None
    return (f"kvd: kv_cache_dtype {name!r} is not supported ({_quant_why(name)}); use auto, fp8, "
            f"fp8_e4m3 or fp8_e5m2, or {NO_KVD}")


def dynamic_scales(vllm_config, kv_cache_config, environ) -> str | None:
    cache = vllm_config.cache_config
    if getattr(cache, "calculate_kv_scales", False) and str(cache.cache_dtype).startswith("fp8"):
        return ("kvd: calculate_kv_scales is not supported (the fp8 KV scales are computed in the "
                "first forward, after kvd named the cache by its scales); use the checkpoint's "
                f"scales (drop calculate_kv_scales) or {NO_KVD}")
    return None


# ---- the KV cache vLLM planned --------------------------------------------------------

def kv_cache_groups(vllm_config, kv_cache_config, environ) -> str | None:
    groups = layers.target_groups(vllm_config, kv_cache_config)
    if not groups:
        return f"kvd: this model has no KV cache layers kvd could keep; {NO_KVD}"
    sizes = {}
    for specs in _group_specs(vllm_config, kv_cache_config):
        for name, spec in specs.items():
            if not is_state(spec):  # a state block holds no tokens: its size is not a chunk's
                sizes.setdefault(getattr(spec, "block_size", None), name)
    if len(sizes) < 2:
        return None
    (a, a_name), (b, b_name) = list(sizes.items())[:2]
    return (f"kvd: the KV cache groups have blocks of different sizes ({a_name}: {a} tokens; "
            f"{b_name}: {b}); kvd's chunks need one block size: run vLLM with "
            f"--disable-hybrid-kv-cache-manager or {NO_KVD}")


def _group_specs(vllm_config, kv_cache_config) -> list[dict]:
    """Per KV cache group holding target layers: each target layer's spec."""
    return [layers.layer_specs(kv_cache_config.kv_cache_groups[gid], names)
            for gid, names in layers.target_groups(vllm_config, kv_cache_config)]


def state_groups(vllm_config, kv_cache_config, environ) -> str | None:
    """Mamba / linear-attention state: what kvd_client.vllm.states can keep."""
    specs = _target_specs(vllm_config, kv_cache_config)
    states = {n: s for n, s in specs.items() if is_state(s)}
    if not states:
        return None
    name, spec = next(iter(states.items()))
    why = None
    if len(states) == len(specs):
        why = ("kvd keeps a state only next to attention layers, whose chunks say which prefix "
               f"it belongs to; {NO_KVD}")
    elif str(getattr(spec, "mamba_cache_mode", "none")) != "none":
        why = (f"with mamba_cache_mode {spec.mamba_cache_mode!r} (vLLM's prefix caching on) "
               "vLLM's own prefix cache places the states in its blocks; turn prefix caching "
               "off (--no-enable-prefix-caching: kvd is then the prefix cache) or run without "
               "the kvd connector")
    elif state_kind(spec) != "MAMBA2":
        why = (f"only Mamba-2 state layers are tested with kvd (these are "
               f"{state_kind(spec)}); {NO_KVD}")
    elif getattr(spec, "num_speculative_blocks", 0):
        why = ("with speculative decoding a step's state depends on the drafts accepted; run "
               f"without a speculative config {OR_NO_KVD}")
    elif vllm_config.device_config.device_type != "cpu":
        why = f"they are served on vLLM's CPU build only (not tested on a GPU); {NO_KVD}"
    if why is None:
        return None
    return f"kvd: state layers ({name}, MambaSpec) are not supported here: {why}"


def _target_specs(vllm_config, kv_cache_config) -> dict:
    return {n: s for specs in _group_specs(vllm_config, kv_cache_config) for n, s in specs.items()}


def layer_kinds(vllm_config, kv_cache_config, environ) -> str | None:
    for name, spec in _target_specs(vllm_config, kv_cache_config).items():
        kind = type(spec).__name__
        if kind not in LAYER_KINDS:
            why = WHY_KIND.get(kind, "kvd does not know what its blocks hold")
            return f"kvd: {kind} layers ({name}) are not supported ({why}); {NO_KVD}"
    return None


def quant_mode(vllm_config, kv_cache_config, environ) -> str | None:
    for name, spec in _target_specs(vllm_config, kv_cache_config).items():
        mode = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
        if mode not in QUANT_MODES:
            return (f"kvd: KV cache quantisation {mode} (layer {name}, from kv_cache_dtype or the "
                    f"checkpoint's kv_cache_scheme) is not supported; use auto or fp8, or {NO_KVD}")
    return None


def _shape(spec) -> str:
    if is_state(spec):
        return f"MambaSpec {spec.shapes} {[str(d).removeprefix('torch.') for d in spec.dtypes]}"
    mode = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    v = getattr(spec, "head_size_v", None) or spec.head_size
    heads = f"{spec.num_kv_heads} heads x {spec.head_size}" + (f"/{v}" if v != spec.head_size else "")
    return f"{type(spec).__name__} {heads} {str(spec.dtype).removeprefix('torch.')} {mode}"


def mixed_layers(vllm_config, kv_cache_config, environ) -> str | None:
    for specs in _group_specs(vllm_config, kv_cache_config):  # a namespace per group
        seen: dict[str, str] = {}
        for name, spec in specs.items():
            seen.setdefault(_shape(spec), name)
        if len(seen) > 1:
            break
    else:
        return None
    (a, a_name), (b, b_name) = list(seen.items())[:2]
    return (f"kvd: the KV cache's layers differ ({a_name}: {a}; {b_name}: {b}), e.g. from "
            "kv_cache_dtype_skip_layers; kvd needs one shape and dtype for every layer: run "
            f"without what makes them differ {OR_NO_KVD}")


def kv_head_sizes(vllm_config, kv_cache_config, environ) -> str | None:
    for name, spec in _target_specs(vllm_config, kv_cache_config).items():
        v = getattr(spec, "head_size_v", None)
        if type(spec).__name__ not in ("MLAAttentionSpec", "MambaSpec") and v and v != spec.head_size:
            return (f"kvd: layer {name} has K heads of {spec.head_size} and V heads of {v} "
                    f"elements; kvd needs K and V of one size: {NO_KVD}")
    return None


CHECKS = (pipeline_parallel, context_parallel, sleep_mode, cumem_allocator, expandable_segments,
          cache_dtype, dynamic_scales, layer_kinds, state_groups, kv_cache_groups, quant_mode,
          mixed_layers, kv_head_sizes)


def refusal(vllm_config, kv_cache_config, environ) -> str | None:
    """The first check's reason, or None: kvd can serve this engine."""
    for check in CHECKS:
        reason = check(vllm_config, kv_cache_config, environ)
        if reason:
            return reason
    return None
