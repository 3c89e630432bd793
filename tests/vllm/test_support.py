"""Which vLLM engines kvd serves, from vLLM's configs alone (no vLLM): refusals and namespaces.

vLLM's configs are stand-ins with the attributes the connector reads (the
spec classes carry vLLM's class names, which the checks go by). Each
refusal of kvd_client.vllm.support is one line naming the setting and what
to do; the namespace tells fp8 dtypes and scales apart and leaves a
speculative drafter's layers out; vLLM's kernel block splitting is undone
where a block's tokens stay evenly spaced (checked byte by byte through
the daemon's own host copy views) and refused where they are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import pytest

from kvd.copy.host_ops import plane_view
from kvd_client.vllm import geometry as G
from kvd_client.vllm import layers, support
from kvd_client.vllm import spec as spec_mod
from kvd_protocol import layout as L
from kvd_protocol.keys import Namespace, namespace_digest


# vLLM's KV cache spec classes, by the names the checks read
@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int = 16
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: str = "torch.bfloat16"
    head_size_v: int | None = None
    kv_quant_mode: object = None


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 64
    extra_retained_tokens: int = 0


@dataclass(frozen=True)
class Dtype:
    name: str
    itemsize: int

    def __str__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True)
class MambaSpec:  # vLLM 0.32's with prefix caching off: one state block of max_model_len tokens
    block_size: int = 2048
    shapes: tuple = ((3, 160), (8, 16, 16))          # conv state (SD), SSM state
    dtypes: tuple = (Dtype("bfloat16", 2), Dtype("float32", 4))
    page_size_bytes: int = 16384                     # padded to the attention page
    mamba_type: str = "MAMBA2"                       # vLLM's enum; its name goes in the format
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0


class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs:
    kv_cache_specs: dict = field(default_factory=dict)
    block_size: int = 16


def group(layer_names, spec=None):
    return SimpleNamespace(layer_names=list(layer_names), kv_cache_spec=spec or FullAttentionSpec())


def configs(device="cuda", cache_dtype="auto", groups=None, drafter=False, **settings):
    """(vllm_config, kv_cache_config) of a 2-layer model; ``settings`` override single fields."""
    par = dict(pipeline_parallel_size=1, tensor_parallel_size=1, decode_context_parallel_size=1,
               prefill_context_parallel_size=1)
    model = dict(model="org/m", revision=None, use_mla=False, enable_sleep_mode=False,
                 enable_cumem_allocator=False, get_total_num_hidden_layers=lambda: 2)
    cache = dict(cache_dtype=cache_dtype, calculate_kv_scales=False)
    for key, value in settings.items():
        next(d for d in (par, model, cache) if key in d)[key] = value
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(**par), model_config=SimpleNamespace(**model),
        cache_config=SimpleNamespace(**cache), device_config=SimpleNamespace(device_type=device),
        speculative_config=SimpleNamespace(num_speculative_tokens=2) if drafter else None)
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    return vllm_config, SimpleNamespace(kv_cache_groups=groups or [group(names)],
                                        kv_cache_layout="LBNHC")


def refusal(vllm_config, kv_cache_config, environ=None):
    return support.refusal(vllm_config, kv_cache_config, environ or {})


# ---- refusals ---------------------------------------------------------------------------

NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
REFUSED = {
    "decode-context-parallel": (dict(decode_context_parallel_size=2),
                                "decode_context_parallel_size 2 is not supported"),
    "prefill-context-parallel": (dict(prefill_context_parallel_size=2),
                                 "prefill_context_parallel_size 2 is not supported"),
    "pipeline-parallel": (dict(pipeline_parallel_size=2), "pipeline_parallel_size 2"),
    "sleep-mode": (dict(enable_sleep_mode=True), "enable_sleep_mode is not supported"),
    "cumem-allocator": (dict(enable_cumem_allocator=True), "enable_cumem_allocator is not"),
    "fp8-ds-mla": (dict(cache_dtype="fp8_ds_mla"), "kv_cache_dtype 'fp8_ds_mla' is not supported"),
    "nvfp4": (dict(cache_dtype="nvfp4"), "kv_cache_dtype 'nvfp4' is not supported"),
    "per-token-head": (dict(cache_dtype="fp8_per_token_head"), "'fp8_per_token_head' is not"),
    "int8-per-token-head": (dict(cache_dtype="int8_per_token_head"), "per-token, per-head"),
    "turboquant": (dict(cache_dtype="turboquant_k8v4"), "'turboquant_k8v4' is not supported"),
    "fp8-inc": (dict(cache_dtype="fp8_inc"), "'fp8_inc' is not supported"),
    "dynamic-scales": (dict(cache_dtype="fp8", calculate_kv_scales=True),
                       "calculate_kv_scales is not supported"),
    "group-block-sizes": (dict(groups=[group(NAMES[:1]),
                                       group(NAMES[1:], SlidingWindowSpec(block_size=32))]),
                          "KV cache groups have blocks of different sizes"),
    "mamba": (dict(device="cpu", groups=[group(NAMES, MambaSpec())]),
              "state layers (model.layers.0.self_attn.attn, MambaSpec) are not supported here: "
              "kvd keeps a state only next to attention layers"),
    "mamba-gpu": (dict(groups=[group(NAMES[:1]), group(NAMES[1:], MambaSpec())]),
                  "served on vLLM's CPU build only"),
    "mamba-align": (dict(device="cpu", groups=[group(NAMES[:1]),
                                               group(NAMES[1:], MambaSpec(mamba_cache_mode="align"))]),
                    "mamba_cache_mode 'align' (vLLM's prefix caching on)"),
    "mamba1": (dict(device="cpu", groups=[group(NAMES[:1]),
                                          group(NAMES[1:], MambaSpec(mamba_type="MAMBA1"))]),
               "only Mamba-2 state layers are tested with kvd (these are MAMBA1)"),
    "linear-attention": (dict(device="cpu", groups=[
        group(NAMES[:1]), group(NAMES[1:], MambaSpec(mamba_type="LINEAR"))]),
        "only Mamba-2 state layers are tested with kvd (these are LINEAR)"),
    "mamba-speculative": (dict(device="cpu", groups=[
        group(NAMES[:1]), group(NAMES[1:], MambaSpec(num_speculative_blocks=2))]),
        "with speculative decoding a step's state depends on the drafts accepted"),
    "mixed-heads": (dict(groups=[group(NAMES, UniformTypeKVCacheSpecs({
        NAMES[0]: FullAttentionSpec(), NAMES[1]: FullAttentionSpec(num_kv_heads=4)}))]),
        "layers differ (model.layers.0.self_attn.attn: FullAttentionSpec 2 heads x 64 bfloat16"),
    "mixed-dtypes": (dict(groups=[group(NAMES, UniformTypeKVCacheSpecs({
        NAMES[0]: FullAttentionSpec(), NAMES[1]: FullAttentionSpec(dtype="torch.uint8")}))]),
        "kv_cache_dtype_skip_layers"),
    "quant-mode": (dict(groups=[group(NAMES, FullAttentionSpec(
        kv_quant_mode=SimpleNamespace(name="NVFP4")))]), "KV cache quantisation NVFP4"),
    "v-head-size": (dict(groups=[group(NAMES, FullAttentionSpec(head_size_v=32))]),
                    "K heads of 64 and V heads of 32"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_each_refusal_is_one_line_naming_the_setting_and_what_to_do(case):
    settings, expected = REFUSED[case]
    reason = refusal(*configs(**settings))
    assert reason is not None and expected in reason, reason
    assert reason.startswith("kvd: ") and "\n" not in reason
    assert "run without" in reason or "use " in reason
    assert refusal(*configs()) is None          # the plain model is served


@pytest.mark.parametrize("var", support.ALLOC_CONF)
def test_expandable_segments_are_refused_on_a_gpu_only(var):
    env = {var: "garbage_collection_threshold:0.6, expandable_segments:True"}
    reason = refusal(*configs(), env)
    assert reason.startswith(f"kvd: {var} sets expandable_segments:True") and "\n" not in reason
    assert refusal(*configs("cpu"), env) is None           # CPU caches live in /dev/shm
    assert refusal(*configs(), {var: "expandable_segments:False"}) is None


@pytest.mark.parametrize("dtype", ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_plain_and_per_tensor_fp8_caches_are_served(dtype):
    assert refusal(*configs(cache_dtype=dtype)) is None
    assert refusal(*configs(groups=[group(NAMES, MLAAttentionSpec())])) is None
    assert refusal(*configs(groups=[group(NAMES, UniformTypeKVCacheSpecs(
        {n: FullAttentionSpec() for n in NAMES}))])) is None   # per-layer specs, all alike


# ---- namespaces -------------------------------------------------------------------------

def digest(geo: G.KVGeometry) -> bytes:
    return namespace_digest(Namespace(chunk_tokens=64, **geo.attach_fields()))


def test_fp8_namespaces_differ_by_dtype_and_by_scales():
    plain = spec_mod.geometry(*configs())
    e4m3 = spec_mod.geometry(*configs(cache_dtype="fp8"), kv_scales="aa")
    assert (plain.kv_dtype, plain.fingerprint, e4m3.kv_dtype) == ("bfloat16", "", "float8_e4m3fn")
    assert e4m3.fingerprint == "kv_scales=aa"
    assert digest(spec_mod.geometry(*configs(cache_dtype="fp8_e4m3"), kv_scales="aa")) == digest(e4m3)
    others = [plain, spec_mod.geometry(*configs(cache_dtype="fp8_e5m2"), kv_scales="aa"),
              spec_mod.geometry(*configs(cache_dtype="fp8"), kv_scales="bb")]
    assert len({digest(g) for g in [e4m3, *others]}) == 4
    with pytest.raises(ValueError, match="needs its scales"):
        spec_mod.geometry(*configs(cache_dtype="fp8"))   # never a namespace without them
    assert spec_mod.needs_scales(*configs(cache_dtype="fp8_e5m2"))
    assert not spec_mod.needs_scales(*configs())


def attention_layers(scales):
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={
        name: SimpleNamespace(_k_scale_float=k, _v_scale_float=v)
        for name, (k, v) in zip(NAMES, scales)}))


def test_scale_digest_follows_every_layers_k_and_v_scale():
    base = layers.kv_scales(attention_layers([(1.0, 1.0), (1.0, 1.0)]), NAMES)
    assert base == layers.kv_scales(attention_layers([(1.0, 1.0), (1.0, 1.0)]), NAMES)
    changed = [[(0.5, 1.0), (1.0, 1.0)], [(1.0, 1.0), (1.0, 0.25)], [(1.0, 1.0), (1.0, 1.0 + 2**-40)]]
    assert len({base, *(layers.kv_scales(attention_layers(s), NAMES) for s in changed)}) == 4
    with pytest.raises(ValueError, match="no fp8 KV scales"):
        layers.kv_scales(attention_layers([(1.0, 1.0)]), NAMES)


DRAFTERS = {
    "draft-model": ["draft_model.model.layers.0.self_attn.attn"],      # the draft_model method
    "eagle-or-mtp": ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"],
}


@pytest.mark.parametrize("kind", DRAFTERS, ids=list(DRAFTERS))
def test_a_drafters_layers_are_left_out_of_the_targets_namespace(kind):
    alone = spec_mod.geometry(*configs())
    same_group = configs(drafter=True, groups=[group(NAMES + DRAFTERS[kind])])
    assert refusal(*same_group) is None
    assert spec_mod.target_layers(*same_group)[0] == NAMES
    assert digest(spec_mod.geometry(*same_group)) == digest(alone)
    # a drafter of another shape: its own group, or other per-layer specs in the target's
    own_group = configs(drafter=True, groups=[group(NAMES), group(DRAFTERS[kind], FullAttentionSpec(
        num_kv_heads=1))])
    mixed = configs(drafter=True, groups=[group(NAMES + DRAFTERS[kind], UniformTypeKVCacheSpecs({
        **{n: FullAttentionSpec() for n in NAMES}, **{n: FullAttentionSpec(num_kv_heads=1)
                                                       for n in DRAFTERS[kind]}}))])
    for cfg in (own_group, mixed):
        assert refusal(*cfg) is None and digest(spec_mod.geometry(*cfg)) == digest(alone)
    # without a speculative config the same names are the model's own layers
    assert spec_mod.target_layers(*configs(groups=[group(NAMES + DRAFTERS[kind])]))[0] != NAMES


# ---- kernel block splitting ---------------------------------------------------------------

def split_cache(order: str, layers_=2, blocks=4, r=4, kernel=4, heads=2, width=16):
    """A vLLM cache whose ``blocks`` blocks are split into ``r`` kernel blocks of ``kernel``
    tokens: logical ``[blocks * r, heads, kernel, width]`` per layer, physically tokens outer
    (``NHC``) or heads outer (``HNC``) inside a kernel block. Returns (refs, logical, bytes)."""
    phys = (blocks * r, kernel, heads, width) if order == "NHC" else (blocks * r, heads, kernel, width)
    buf = np.arange(layers_ * np.prod(phys), dtype=np.uint16).reshape(layers_, *phys)
    logical = buf.transpose(0, 1, 3, 2, 4) if order == "NHC" else buf
    refs = [L.TensorRef(0, layer * buf.strides[0], logical.shape[1:], logical.strides[1:], 2)
            for layer in range(layers_)]
    return refs, logical, buf.reshape(-1).view(np.uint8)


def test_split_blocks_with_evenly_spaced_tokens_map_to_vllms_blocks_byte_for_byte():
    geo = spec_mod.geometry(*configs(groups=[group(NAMES, FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8))]), block_format="rows")
    refs, logical, raw = split_cache("NHC")
    d = G.describe(geo, refs, 4)
    assert (d.num_pages, d.page_size, d.heads) == (4, 16, 2)
    for layer in range(2):
        for plane in range(2):
            got = plane_view([raw], d, layer, plane).view(np.uint16)  # [block, token, head, 8]
            for b in range(4):
                for t in range(16):   # vLLM's kernel block b * 4 + t // 4 holds token t of b
                    want = logical[layer, b * 4 + t // 4, :, t % 4, plane * 8:(plane + 1) * 8]
                    assert np.array_equal(got[b, t], want)


def test_split_mla_blocks_merge_in_both_vllm_shapes():
    mla = G.KVGeometry(model="m", kv_dtype="bfloat16", attention="mla", num_layers=2, kv_heads=1,
                       head_dim=16, tp_size=1, block_size=16)
    refs, _, _ = split_cache("NHC", heads=1)                  # 0.32: [B * r, 1, k, C]
    flat = [L.TensorRef(r.buffer, r.offset, (16, 4, 16), (r.strides[0], r.strides[2], 2), 2)
            for r in refs]                                    # 0.26: [B * r, k, C]
    for rs in (refs, flat):
        d = G.describe(mla, rs, 4)
        assert (d.num_pages, d.page_size, d.page_stride, d.token_stride) == (4, 16, 16 * 32, 32)


def test_split_blocks_with_heads_outside_the_tokens_are_refused_in_one_line():
    geo = spec_mod.geometry(*configs(groups=[group(NAMES, FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=8))]), block_format="rows")
    with pytest.raises(ValueError, match="not evenly spaced") as err:
        G.describe(geo, split_cache("HNC")[0], 4)
    assert "\n" not in str(err.value) and "VLLM_KV_CACHE_LAYOUT" in str(err.value)
    opaque = replace(geo, attention="opaque", interior="HNC", head_dim=16)
    with pytest.raises(ValueError, match="whole blocks"):      # whole blocks never split
        G.describe(opaque, split_cache("NHC")[0], 4)
