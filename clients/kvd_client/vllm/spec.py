"""``KVGeometry`` from vLLM's configs, the same in the scheduler and every worker.

Reads ``VllmConfig`` and ``KVCacheConfig`` by attribute, per KV cache group, once
kvd_client.vllm.support refused nothing: target layers, block size, KV heads of this TP
shard, head size, dtypes, TP size. fp8 namespaces carry a digest of the K/V scales, so
engines with other scales never share. MLA is attention ``mla``; GPU blocks are ``opaque``
whole blocks by default (``vllm-gpu`` page format) or ``mha`` rows; CPU blocks ``opaque``
with a page format naming layout, version and ISA; state groups ``opaque`` state pages.
A dtype kvd has no name for raises ``ValueError``.
"""

from __future__ import annotations

import math

from kvd_protocol.limits import MAX_HEAD_DIM, MAX_KV_HEADS

from . import layers
from .geometry import STATE, KVGeometry, interior_of, page_format
from .groups import KVGroup, group_tag, joined_fingerprint, kv_groups, state_kind

KV_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
             "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
SCALED = ("float8_e4m3fn", "float8_e5m2")  # kvd dtypes whose blocks need their scales


def target_layers(vllm_config, kv_cache_config, group: KVGroup | None = None) -> tuple[list[str], object]:
    """A group's target layer names and their (common) spec (default: the first of
    ``groups.kv_groups``): support.py checked both."""
    group = group or kv_groups(vllm_config, kv_cache_config)[0]
    names = list(group.names)
    return names, layers.layer_specs(kv_cache_config.kv_cache_groups[group.gid], names)[names[0]]


def all_target_layers(vllm_config, kv_cache_config) -> list[str]:
    """Every attention group's target layers, group after group (the fp8 scales' digest covers
    them all; state layers have no KV scales)."""
    return [n for g in kv_groups(vllm_config, kv_cache_config) if not g.state for n in g.names]


def needs_scales(vllm_config, kv_cache_config) -> bool:
    """Whether the namespace carries fp8 scales (the scheduler must learn them first)."""
    spec = target_layers(vllm_config, kv_cache_config)[1]
    return kv_dtype(vllm_config.cache_config.cache_dtype, spec.dtype) in SCALED


def geometry(vllm_config, kv_cache_config, model_id: str = "", kv_scales: str = "",
             block_format: str = "blocks", interior: str = "",
             group: KVGroup | None = None, chunk_tokens: int = 0) -> KVGeometry:
    """The namespace and layout facts; ``kv_scales`` (``layers.kv_scales``) for fp8 caches,
    ``block_format`` (``"blocks"`` or ``"rows"``) for GPU blocks, and their ``interior``
    as the workers' tensors have it (``tensor_interior``; default: what vLLM's config says,
    which an attention backend may override in the workers' processes only); ``group``: the
    KV cache group (default: the first), whose tag joins the fingerprint (kvd_client.vllm.groups);
    ``chunk_tokens``: the daemon's, which a state group's page is (one state per chunk key)."""
    every = kv_groups(vllm_config, kv_cache_config)
    group = group or every[0]
    names, spec = target_layers(vllm_config, kv_cache_config, group)
    par = vllm_config.parallel_config
    if group.state:
        return state_geometry(vllm_config, spec, names, model_id, chunk_tokens,
                              group_tag(group, len(every)))
    dtype = kv_dtype(vllm_config.cache_config.cache_dtype, spec.dtype)
    if dtype in SCALED and not kv_scales:
        raise ValueError("kvd: an fp8 KV cache's namespace needs its scales (layers.kv_scales)")
    model = model_id or model_identity(vllm_config.model_config)
    common = dict(kv_dtype=dtype, num_layers=len(names), tp_size=par.tensor_parallel_size,
                  block_size=spec.block_size,
                  fingerprint=joined_fingerprint(f"kv_scales={kv_scales}" if dtype in SCALED else "",
                                                 group_tag(group, len(every))))
    if _is_mla(spec, vllm_config):
        return KVGeometry(model=model, attention="mla", kv_heads=1, head_dim=spec.head_size, **common)
    if vllm_config.device_config.device_type != "cpu":
        if block_format == "blocks":
            interior = interior or block_interior(vllm_config, kv_cache_config)
        if block_format != "blocks" or not interior:
            return KVGeometry(model=model, attention="mha", kv_heads=spec.num_kv_heads,
                              head_dim=spec.head_size, **common)
        engine, isa = "vllm-gpu", ""
    else:  # CPU attention packs K transposed inside a block, per ISA: whole blocks, own namespace
        interior = interior_of(kv_cache_layout(vllm_config, kv_cache_config))
        engine, isa = f"vllm-cpu {vllm_version()}", cpu_isa(spec, vllm_config)
    fmt = page_format(engine, interior, spec.block_size, isa)
    return KVGeometry(model=f"{model}|{fmt}", attention="opaque", kv_heads=spec.num_kv_heads,
                      head_dim=2 * spec.head_size, interior=interior, **common)


def state_geometry(vllm_config, spec, names: list[str], model_id: str, chunk_tokens: int,
                   tag: str) -> KVGeometry:
    """A state group's namespace: the state's bytes, as ``chunk_tokens`` rows of a page."""
    if chunk_tokens < 1:
        raise ValueError("kvd: a state group's namespace needs the daemon's chunk_tokens")
    content = sum(math.prod(int(n) for n in shape) * dtype.itemsize for shape, dtype in zip(spec.shapes, spec.dtypes))
    row = -(-content // chunk_tokens)
    if row * chunk_tokens > spec.page_size_bytes:
        raise ValueError(f"kvd: a state of {content} bytes in blocks of {spec.page_size_bytes} "
                         f"does not fit whole rows of a {chunk_tokens}-token chunk; use a "
                         "chunk_tokens that divides the state's size, or run without the kvd "
                         "connector")
    heads = next((h for h in range(1, MAX_KV_HEADS + 1) if row % h == 0
                  and row // h <= MAX_HEAD_DIM), 0)
    if not heads:
        raise ValueError(f"kvd: a state row of {row} bytes has no split into at most "
                         f"{MAX_KV_HEADS} pieces of at most {MAX_HEAD_DIM}; use a larger "
                         "chunk_tokens, or run without the kvd connector")
    kind = state_kind(spec)
    dtypes = ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    shapes = ",".join("x".join(map(str, s)) for s in spec.shapes)
    fmt = f"vllm-{vllm_config.device_config.device_type} {vllm_version()} {STATE} {kind} " \
          f"{shapes} {dtypes}"
    model = model_id or model_identity(vllm_config.model_config)
    return KVGeometry(model=f"{model}|{fmt}", kv_dtype="uint8", attention="opaque",
                      num_layers=len(names), kv_heads=heads, head_dim=row // heads,
                      tp_size=vllm_config.parallel_config.tensor_parallel_size,
                      block_size=chunk_tokens, interior=STATE, fingerprint=tag)


def gpu_blocks(vllm_config, kv_cache_config, block_format: str) -> bool:
    """Whether the namespace names the order inside GPU blocks: known for sure only once
    the workers hold their tensors (their handshake tells the scheduler)."""
    return vllm_config.device_config.device_type != "cpu" and block_format == "blocks" \
        and not _is_mla(target_layers(vllm_config, kv_cache_config)[1], vllm_config) \
        and bool(block_interior(vllm_config, kv_cache_config))


def tensor_interior(ref) -> str:
    """The order inside the blocks of a ``[blocks, heads, block_size, 2 * head]`` tensor
    (a ``TensorRef``): heads outer (``HNC``) or tokens outer (``NHC``)."""
    return "HNC" if ref.shape[1] == 1 or ref.strides[1] >= ref.strides[2] else "NHC"


def block_interior(vllm_config, kv_cache_config) -> str:
    """The order inside a GPU block, or "" where a (layer, block) is not one byte range
    (heads or tokens outside the blocks): such caches go as token rows."""
    try:
        return interior_of(kv_cache_layout(vllm_config, kv_cache_config))
    except ValueError:
        return ""


def model_identity(model_config) -> str:
    revision = getattr(model_config, "revision", None)
    return f"{model_config.model}@{revision}" if revision else str(model_config.model)


def kv_dtype(cache_dtype: str, spec_dtype) -> str:
    name = str(spec_dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    if name not in KV_DTYPES:
        raise ValueError(f"kvd: kv_cache_dtype {cache_dtype!r} gives KV blocks of {name}, which "
                         "kvd does not support; use auto (float16, bfloat16, float32), fp8, "
                         "fp8_e4m3 or fp8_e5m2, or run without the kvd connector")
    return KV_DTYPES[name]


def _is_mla(spec, vllm_config) -> bool:
    return "MLA" in type(spec).__name__ or bool(getattr(vllm_config.model_config, "use_mla", False))


def kv_cache_layout(vllm_config, kv_cache_config) -> str:
    name = getattr(kv_cache_config, "kv_cache_layout", None) \
        or getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if name:
        return str(name)
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import get_kv_cache_layout  # vLLM 0.26

    # the scheduler of a multi-process (TP > 1) engine builds its connector outside vLLM's
    # config context, which get_kv_cache_layout reads
    with set_current_vllm_config(vllm_config):
        return str(get_kv_cache_layout())


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def cpu_isa(spec, vllm_config) -> str:
    """The ISA vLLM's CPU attention packs blocks for (vLLM's own choice)."""
    from vllm.v1.attention.backends import cpu_attn

    return cpu_attn._get_attn_isa(spec.dtype, spec.block_size, spec.head_size,
                                  vllm_config.cache_config.cache_dtype)
