"""Which of vLLM's KV cache layers kvd moves (the target model's), and their per-layer specs.

kvd keeps only the target model's KV, so engines with and without a speculative drafter
share a namespace; drafter layers (under ``draft_model.``, or indexed past the target's
layer count) are neither stored nor loaded, which may lower acceptance, never change
output. ``target_groups``: groups holding target layers; ``layer_specs``: each layer's spec;
``kv_scales``: a digest of the layers' fp8 K/V scales (worker only). Never imports vLLM.
"""

from __future__ import annotations

import hashlib

DRAFT_PREFIX = "draft_model."


def target_groups(vllm_config, kv_cache_config) -> list[tuple[int, list[str]]]:
    limit = _target_layer_count(vllm_config)
    out = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        names = [n for n in group.layer_names if not _is_drafter(n, limit)]
        if names:
            out.append((gid, names))
    return out


def _target_layer_count(vllm_config) -> int | None:
    """The target's layer count when a speculative config may add drafter layers, else None."""
    if getattr(vllm_config, "speculative_config", None) is None:
        return None
    return int(vllm_config.model_config.get_total_num_hidden_layers())


def _is_drafter(name: str, limit: int | None) -> bool:
    if limit is None:
        return False
    if name.startswith(DRAFT_PREFIX):
        return True
    index = layer_index(name)
    return index is not None and index >= limit


def layer_index(name: str) -> int | None:
    """The first integer component of a module name (``model.layers.12.self_attn.attn``: 12)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def layer_specs(group, names: list[str]) -> dict:
    per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    if per_layer is None:
        return {name: group.kv_cache_spec for name in names}
    return {name: per_layer[name] for name in names}


def kv_scales(vllm_config, names: list[str]) -> str:
    """16 hex digits of SHA-256 over every layer's K and V scale, in layer order: engines whose
    fp8 blocks were quantised with other scales must never share them."""
    context = vllm_config.compilation_config.static_forward_context
    values = []
    for name in names:
        layer = context.get(name)
        k, v = getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None)
        if k is None or v is None:
            raise ValueError(f"kvd: vLLM's attention layer {name} has no fp8 KV scales "
                             "(_k_scale_float/_v_scale_float); run without the kvd connector")
        values.append(f"{float(k).hex()},{float(v).hex()}")
    return hashlib.sha256(";".join(values).encode()).hexdigest()[:16]
