"""``KVGeometry`` from vLLM's configs, the same in the scheduler and every worker.

Reads ``VllmConfig`` and ``KVCacheConfig`` by attribute (vLLM 0.26 to 0.32):
one KV cache group (hybrid models with several groups are refused), its
spec's block size, KV heads of this TP shard, head size and dtype, the
cache dtype (``auto``, ``fp8``/``fp8_e4m3``, ``fp8_e5m2``; quantized formats
with scales are refused) and the TP size (pipeline parallelism is refused:
kvd's namespace here has no layer offset). MLA caches are attention
``mla``; other caches on a GPU are attention ``mha`` under the plain model
identity (token rows, whatever order the attention backend picked: the
descriptor follows the tensors' strides), so their chunks are SGLang's too.
On CPU (``device_type == "cpu"``) blocks stay ``opaque``: the page format
appended to the model names the physical order inside a block
(``kv_cache_config.kv_cache_layout`` (0.32), else vLLM's
``get_kv_cache_layout()`` (0.26)), the vLLM version and the attention ISA
vLLM picks (``amx``, ``vec``, ...), because CPU blocks are packed per ISA.
Everything refused raises ``ValueError`` with the reason.
"""

from __future__ import annotations

from .geometry import KVGeometry, interior_of, page_format

KV_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
             "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def geometry(vllm_config, kv_cache_config, model_id: str = "") -> KVGeometry:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvd supports models with one KV cache group; this one has {len(groups)} "
                         "(hybrid attention): run vLLM with --disable-hybrid-kv-cache-manager")
    spec, layers = groups[0].kv_cache_spec, list(groups[0].layer_names)
    par = vllm_config.parallel_config
    if getattr(par, "pipeline_parallel_size", 1) != 1:
        raise ValueError("kvd's vLLM connector does not support pipeline parallelism yet")
    dtype = kv_dtype(vllm_config.cache_config.cache_dtype, spec.dtype)
    model = model_id or model_identity(vllm_config.model_config)
    common = dict(kv_dtype=dtype, num_layers=len(layers), tp_size=par.tensor_parallel_size,
                  block_size=spec.block_size)
    if _is_mla(spec, vllm_config):
        return KVGeometry(model=model, attention="mla", kv_heads=1, head_dim=spec.head_size, **common)
    if vllm_config.device_config.device_type != "cpu":
        return KVGeometry(model=model, attention="mha", kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_size, **common)
    # CPU attention packs K transposed inside a block, per ISA: whole blocks, own namespace
    interior = interior_of(kv_cache_layout(vllm_config, kv_cache_config))
    engine, isa = f"vllm-cpu {vllm_version()}", cpu_isa(spec, vllm_config)
    fmt = page_format(engine, interior, spec.block_size, isa)
    return KVGeometry(model=f"{model}|{fmt}", attention="opaque", kv_heads=spec.num_kv_heads,
                      head_dim=2 * spec.head_size, interior=interior, **common)


def model_identity(model_config) -> str:
    revision = getattr(model_config, "revision", None)
    return f"{model_config.model}@{revision}" if revision else str(model_config.model)


def kv_dtype(cache_dtype: str, spec_dtype) -> str:
    name = str(spec_dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    if name not in KV_DTYPES:
        raise ValueError(f"kvd does not support vLLM's KV cache dtype {name!r} (supported: auto, "
                         "float16, bfloat16, float32, fp8, fp8_e4m3, fp8_e5m2)")
    return KV_DTYPES[name]


def _is_mla(spec, vllm_config) -> bool:
    return "MLA" in type(spec).__name__ or bool(getattr(vllm_config.model_config, "use_mla", False))


def kv_cache_layout(vllm_config, kv_cache_config) -> str:
    name = getattr(kv_cache_config, "kv_cache_layout", None) \
        or getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if name:
        return str(name)
    from vllm.v1.attention.backends.utils import get_kv_cache_layout  # vLLM 0.26

    return str(get_kv_cache_layout())


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def cpu_isa(spec, vllm_config) -> str:
    """The ISA vLLM's CPU attention packs blocks for (vLLM's own choice)."""
    from vllm.v1.attention.backends import cpu_attn

    return cpu_attn._get_attn_isa(spec.dtype, spec.block_size, spec.head_size,
                                  vllm_config.cache_config.cache_dtype)
