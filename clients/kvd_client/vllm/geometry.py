"""What kvd needs to know about a vLLM KV cache, and how its tensors map to kvd.

``KVGeometry`` comes from vLLM's configs alone (kvd_client.vllm.spec), identical in scheduler
and workers, so both name one namespace. Kinds: MLA (``vllm_mla``); GPU blocks, kept whole
by default (page format ``vllm-gpu <interior> bs=<n>``, moved by copy engines) or as
head-strided rows (``"rows"``: attention ``mha``, shared with SGLang); CPU attention blocks
(``opaque``, ISA-packed); state blocks (Mamba, linear attention). ``describe(geometry, refs,
num_blocks)`` turns a worker's tensors into a layout descriptor, merging split kernel blocks
back into vLLM's blocks; a layout kvd cannot map raises ``ValueError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd_protocol import layout as L

STATE = "state"  # KVGeometry.interior of a state group's pages


@dataclass(frozen=True)
class KVGeometry:
    model: str          # model identity, plus the page format for opaque pages
    kv_dtype: str       # kvd dtype name
    attention: str      # "mla", "mha" (GPU blocks) or "opaque" (CPU blocks)
    num_layers: int
    kv_heads: int       # per TP shard; 1 for MLA
    head_dim: int       # MLA: latent width; mha: head size; opaque: 2 x head size (K and V)
    tp_size: int
    block_size: int     # tokens per vLLM block (a kvd page)
    interior: str = ""  # opaque: the physical order inside a block, "HNC" or "NHC"
    fingerprint: str = ""  # fp8: "kv_scales=<digest>" (kvd_client.vllm.spec)

    @property
    def layout(self) -> str:
        """The kvd_protocol.layout name of the worker's tensors."""
        return {"mla": "vllm_mla", "mha": "vllm_kv_blocks"}.get(self.attention, "opaque")

    def attach_fields(self) -> dict:
        return {"model": self.model, "kv_dtype": self.kv_dtype, "attention": self.attention,
                "num_layers": self.num_layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "tp_size": self.tp_size, "fingerprint": self.fingerprint}


def page_format(engine: str, interior: str, block_size: int, isa: str = "") -> str:
    """The opaque page format, appended to the model identity: chunks are
    interchangeable only between pools whose pages are laid out alike."""
    return f"{engine} {interior}{f' isa={isa}' if isa else ''} bs={block_size}"


def interior_of(layout_name: str) -> str:
    """Physical order inside a block from a vLLM layout name: 0.32's ``LBHNC`` family
    (L and B outside the block) or 0.26's ``HND``/``NHD``."""
    legacy = {"HND": "HNC", "NHD": "NHC"}
    if layout_name in legacy:
        return legacy[layout_name]
    inner = layout_name.replace("L", "").replace("B", "")
    if sorted(layout_name) != sorted("LBHNC") or layout_name[-1] != "C" \
            or layout_name.index("L") > 1 or layout_name.index("B") > 1:
        raise ValueError(f"kvd cannot move vLLM KV cache layout {layout_name!r} as whole blocks: a "
                         "block must be one byte range (layer and block outermost). Set "
                         "VLLM_KV_CACHE_LAYOUT to LBHNC or LBNHC")
    return inner


def describe(geo: KVGeometry, refs: list[L.TensorRef], num_blocks: int) -> L.LayoutDescriptor:
    """kvd's descriptor of the worker's per-layer tensors (in layer order)."""
    if len(refs) != geo.num_layers:
        raise ValueError(f"kvd: vLLM registered {len(refs)} KV layers, its config says {geo.num_layers}")
    if geo.interior == STATE:
        return _states(geo, refs, num_blocks)
    refs = manager_blocks(geo, refs, num_blocks)
    if geo.attention == "mla":
        return _mla(geo, refs)
    if geo.attention == "mha":
        return _blocks(geo, refs)
    return _opaque(geo, refs)


def manager_blocks(geo: KVGeometry, refs: list[L.TensorRef], num_blocks: int) -> list[L.TensorRef]:
    """vLLM's kernel block splitting, undone: where the attention backend needs blocks smaller
    than the scheduler's, vLLM views each of its ``num_blocks`` blocks as ``r`` kernel blocks
    (kernel block ``b * r + j`` holds tokens ``j * k .. (j + 1) * k - 1`` of block ``b``; 0.26
    and 0.32 alike). When one kernel block's tokens continue where the previous one's end
    (tokens outermost inside a kernel block, or one head), the ``r`` kernel blocks are one
    scheduler block with evenly spaced tokens: the same view with blocks ``r`` times as far
    apart and ``r`` times as many tokens. Otherwise the tokens of a block are not evenly
    spaced and kvd refuses, naming what to change."""
    t = refs[0]
    total = t.shape[0] if t.shape else 0
    if total == num_blocks:
        return refs
    tok = 1 if geo.attention == "mla" and len(t.shape) == 3 else 2  # the token dimension
    r = total // num_blocks if num_blocks and total % num_blocks == 0 else 0
    kernel = t.shape[tok] if len(t.shape) > tok else 0
    if geo.attention == "opaque":
        raise ValueError(f"kvd: vLLM splits each {geo.block_size}-token block into kernel blocks "
                         f"(KV tensors of shape {t.shape} for {num_blocks} blocks), which kvd "
                         "cannot keep as whole blocks; use a --block-size the attention backend "
                         "supports (or, on a GPU, the kvd connector's gpu_block_format 'rows')")
    if r < 2 or kernel * r != geo.block_size or t.strides[0] != kernel * t.strides[tok]:
        raise ValueError(f"kvd: vLLM splits each {geo.block_size}-token block into kernel blocks "
                         f"(KV tensors of shape {t.shape}, byte strides {t.strides}, for "
                         f"{num_blocks} blocks) whose tokens are not evenly spaced; use a "
                         "tokens-outer layout (VLLM_KV_CACHE_LAYOUT LBNHC on 0.32, NHD on 0.26), "
                         "a --block-size the attention backend supports, or run without the kvd "
                         "connector")
    return [_merge(ref, tok, r) for ref in refs]


def _merge(ref: L.TensorRef, tok: int, r: int) -> L.TensorRef:
    shape, strides = list(ref.shape), list(ref.strides)
    shape[0] //= r
    shape[tok] *= r
    strides[0] *= r
    return L.TensorRef(ref.buffer, ref.offset, tuple(shape), tuple(strides), ref.itemsize)


def _mla(geo: KVGeometry, refs: list[L.TensorRef]) -> L.LayoutDescriptor:
    t = refs[0]
    if len(t.shape) == 4 and t.shape[1] == 1:  # 0.32: [B, 1, N, C]
        refs = [L.TensorRef(r.buffer, r.offset, (r.shape[0], *r.shape[2:]),
                            (r.strides[0], *r.strides[2:]), r.itemsize) for r in refs]
    try:
        d = L.vllm_mla(refs)
    except ValueError as exc:
        raise ValueError(f"kvd cannot map this vLLM MLA KV cache (shape {t.shape}, byte strides "
                         f"{t.strides}): {exc}") from None
    _check(d.page_size == geo.block_size and d.row_bytes == geo.head_dim * t.itemsize,
           "MLA", t, f"blocks of {geo.block_size} tokens of {geo.head_dim} elements")
    return d


def _blocks(geo: KVGeometry, refs: list[L.TensorRef]) -> L.LayoutDescriptor:
    """GPU blocks as head-strided token rows, in whatever order their strides say."""
    t = refs[0]
    expect = (geo.kv_heads, geo.block_size, 2 * geo.head_dim)
    _check(len(t.shape) == 4 and tuple(t.shape[1:]) == expect, "GPU block", t,
           f"[blocks, {geo.kv_heads} heads, {geo.block_size} tokens, {2 * geo.head_dim}]")
    try:
        return L.vllm_kv_blocks(refs, geo.head_dim)
    except ValueError as exc:
        raise ValueError(f"kvd cannot map this vLLM KV cache (shape {t.shape}, byte strides "
                         f"{t.strides}): {exc}") from None


def _opaque(geo: KVGeometry, refs: list[L.TensorRef]) -> L.LayoutDescriptor:
    t = refs[0]
    expect = (geo.kv_heads, geo.block_size, geo.head_dim)
    _check(len(t.shape) == 4 and tuple(t.shape[1:]) == expect, geo.interior, t,
           f"[blocks, {geo.kv_heads} heads, {geo.block_size} tokens, {geo.head_dim}]")
    actual = "HNC" if t.strides[1] >= t.strides[2] else "NHC"
    _check(actual == geo.interior or geo.kv_heads == 1, geo.interior, t,
           f"the {geo.interior} order inside a block (it is {actual})")
    try:
        return L.opaque_pages(refs, geo.block_size)
    except ValueError as exc:
        raise ValueError(f"kvd cannot map this vLLM KV cache layout ({geo.interior}, shape "
                         f"{t.shape}, byte strides {t.strides}): {exc}") from None


def _states(geo: KVGeometry, refs: list[L.TensorRef], num_blocks: int) -> L.LayoutDescriptor:
    """Each layer's state blocks as opaque pages of ``page`` bytes (the state, whole rows)."""
    t, page = refs[0], geo.block_size * geo.kv_heads * geo.head_dim
    _check(bool(t.shape) and t.shape[0] == num_blocks and t.strides[0] >= page, STATE, t,
           f"{num_blocks} state blocks of at least {page} bytes")
    pages = [L.TensorRef(r.buffer, r.offset, (r.shape[0], page), (r.strides[0], 1), 1) for r in refs]
    try:
        return L.opaque_pages(pages, geo.block_size)
    except ValueError as exc:
        raise ValueError(f"kvd cannot map this vLLM state cache (shape {t.shape}, byte strides "
                         f"{t.strides}): {exc}") from None


def _check(ok: bool, layout: str, t: L.TensorRef, expected: str) -> None:
    if not ok:
        raise ValueError(f"kvd: vLLM's KV cache ({layout} layout, shape {t.shape}, byte strides "
                         f"{t.strides}) is not the {expected} its config implies")
