"""Layout descriptor: where an engine's paged KV pool keeps each token row.

One descriptor covers every engine layout, so copies need one gather and one scatter. Per
(layer, plane) a base ``(buffer, offset)``; token ``t`` of page ``p`` is ``heads`` pieces at
``base + p * page_stride + t * token_stride + h * head_stride`` of ``row_bytes // heads``
bytes. Canonical chunk bytes (``CANONICAL_VERSION``) are ``[layer][plane][token][row]``.
Constructors take ``TensorRef`` (numpy or CUDA) and raise ``ValueError`` on bad shapes;
``validate_extent`` proves every reachable byte lies in its buffer; ``opaque_pages``
describes pages of unknown inner order, moved byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd_protocol.limits import MAX_BYTES, MAX_CHUNK_TOKENS, MAX_KV_HEADS, MAX_LAYERS, MAX_PAGES

CANONICAL_VERSION = 1
CAPS = {"num_layers": MAX_LAYERS, "num_pages": MAX_PAGES, "page_size": MAX_CHUNK_TOKENS,
        "row_bytes": MAX_BYTES, "page_stride": MAX_BYTES, "token_stride": MAX_BYTES,
        "heads": MAX_KV_HEADS, "head_stride": MAX_BYTES}


@dataclass(frozen=True)
class TensorRef:
    """A strided tensor inside a registered buffer (all sizes in bytes)."""

    buffer: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int


@dataclass(frozen=True)
class LayoutDescriptor:
    num_layers: int
    planes: int
    num_pages: int
    page_size: int
    row_bytes: int
    page_stride: int
    token_stride: int
    bases: tuple[tuple[int, int], ...]
    heads: int = 1          # pieces of a row (1: one contiguous range)
    head_stride: int = 0    # bytes from piece h to piece h+1 of one token row

    def __post_init__(self) -> None:
        for name, cap in CAPS.items():
            low = 0 if name.endswith("stride") else 1
            if not low <= getattr(self, name) <= cap:
                raise ValueError(f"{name} must be between {low} and {cap} (kvd_protocol.limits)")
        if self.row_bytes % self.heads:
            raise ValueError(f"row_bytes {self.row_bytes} is not a multiple of heads {self.heads}")
        if self.planes not in (1, 2):
            raise ValueError("planes must be 1 (MLA latent) or 2 (K and V)")
        if len(self.bases) != self.num_layers * self.planes:
            raise ValueError("bases must hold one (buffer, offset) per layer and plane")
        for buf, off in self.bases:
            if not (0 <= buf < 2 * MAX_LAYERS + 2 and 0 <= off <= MAX_BYTES):
                raise ValueError(f"a base must name a buffer below {2 * MAX_LAYERS + 2} and an "
                                 f"offset between 0 and {MAX_BYTES}")

    def base(self, layer: int, plane: int) -> tuple[int, int]:
        return self.bases[layer * self.planes + plane]

    @property
    def piece_bytes(self) -> int:
        """Bytes of one piece (one head's share) of a row."""
        return self.row_bytes // self.heads

    def shard_bytes(self, chunk_tokens: int) -> int:
        """Bytes of one chunk shard in canonical form."""
        return self.num_layers * self.planes * chunk_tokens * self.row_bytes

    def plane_span(self) -> int:
        """Bytes from a plane's base to one past the last byte a page id can reach."""
        return ((self.num_pages - 1) * self.page_stride + (self.page_size - 1) * self.token_stride
                + (self.heads - 1) * self.head_stride + self.piece_bytes)

    def validate_extent(self, buffer_sizes: list[int]) -> None:
        span = self.plane_span()
        for i, (buf, off) in enumerate(self.bases):
            if buf >= len(buffer_sizes):
                raise ValueError(f"base {i} names buffer {buf}, only {len(buffer_sizes)} registered")
            if off + span > buffer_sizes[buf]:
                raise ValueError(f"base {i} reaches byte {off + span}, buffer {buf} "
                                 f"holds {buffer_sizes[buf]}")


def _row_bytes(t: TensorRef, inner_dims: int) -> int:
    """Bytes of the trailing ``inner_dims`` dims, which must be contiguous."""
    expect = t.itemsize
    for dim, stride in zip(reversed(t.shape[-inner_dims:]), reversed(t.strides[-inner_dims:])):
        if dim > 1 and stride != expect:
            raise ValueError(f"the trailing {inner_dims} dims of a KV tensor must be contiguous")
        expect *= dim
    return expect


def _check_rank(t: TensorRef, rank: int, what: str) -> None:
    if len(t.shape) != rank or len(t.strides) != rank:
        raise ValueError(f"{what}: expected a {rank}-d tensor, got shape {t.shape}")


def _same_geometry(layers: list[TensorRef], what: str) -> None:
    if not layers:
        raise ValueError(f"{what}: no layer tensors given")
    first = layers[0]
    for t in layers[1:]:
        if t.shape != first.shape or t.strides != first.strides or t.itemsize != first.itemsize:
            raise ValueError(f"{what}: every layer tensor must have the same shape and strides")


def _paged_kv(layers: list[TensorRef], kv_dim: int, what: str) -> LayoutDescriptor:
    """Per layer ``[.., block_size, kv_heads, head_dim]`` whose dims 0 and 1 are the
    K/V pair (``kv_dim``) and the block index (the other one)."""
    _same_geometry(layers, what)
    t = layers[0]
    _check_rank(t, 5, what)
    if t.shape[kv_dim] != 2:
        raise ValueError(f"{what}: dim {kv_dim} must be 2 (K, V)")
    page_dim = 1 - kv_dim
    bases = tuple((x.buffer, x.offset + p * x.strides[kv_dim]) for x in layers for p in (0, 1))
    return LayoutDescriptor(len(layers), 2, t.shape[page_dim], t.shape[2], _row_bytes(t, 2),
                            t.strides[page_dim], t.strides[2], bases)


def vllm_flash_attn(layers: list[TensorRef]) -> LayoutDescriptor:
    """vLLM flash-attn: per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
    return _paged_kv(layers, 0, "vllm_flash_attn")


def vllm_flashinfer(layers: list[TensorRef]) -> LayoutDescriptor:
    """vLLM FlashInfer: per layer ``[num_blocks, 2, block_size, kv_heads, head_dim]``."""
    return _paged_kv(layers, 1, "vllm_flashinfer")


def vllm_mla(layers: list[TensorRef]) -> LayoutDescriptor:
    """vLLM MLA: per layer ``[num_blocks, block_size, kv_lora_rank + rope_dim]``."""
    _same_geometry(layers, "vllm_mla")
    t = layers[0]
    _check_rank(t, 3, "vllm_mla")
    bases = tuple((x.buffer, x.offset) for x in layers)
    return LayoutDescriptor(len(layers), 1, t.shape[0], t.shape[1], _row_bytes(t, 1),
                            t.strides[0], t.strides[1], bases)


def vllm_kv_blocks(layers: list[TensorRef], head_size: int) -> LayoutDescriptor:
    """vLLM's GPU blocks: per layer the logical ``[num_blocks, kv_heads, block_size,
    2 * head_size]``, K and V side by side inside each head, dims in any physical order
    (``HNC``: heads outer, ``NHC``: tokens outer, blocks of all layers interleaved...)
    as long as the last one is contiguous. A token's K row is its heads' first halves."""
    _same_geometry(layers, "vllm_kv_blocks")
    t = layers[0]
    _check_rank(t, 4, "vllm_kv_blocks")
    if head_size < 1 or t.shape[3] != 2 * head_size:
        raise ValueError(f"vllm_kv_blocks: dim 3 must be 2 x head_size ({head_size}), "
                         f"got shape {t.shape}")
    half = _row_bytes(t, 1) // 2          # one head's K (or V) bytes
    kv_heads = t.shape[1]
    heads, head_stride = (kv_heads, t.strides[1]) if kv_heads > 1 else (1, 0)
    bases = tuple((x.buffer, x.offset + p * half) for x in layers for p in (0, 1))
    return LayoutDescriptor(len(layers), 2, t.shape[0], t.shape[2], kv_heads * half,
                            t.strides[0], t.strides[2], bases, heads, head_stride)


def _token_pool(tensors: list[TensorRef], page_size: int, planes: int, what: str) -> LayoutDescriptor:
    _same_geometry(tensors, what)
    t = tensors[0]
    _check_rank(t, 3, what)
    if page_size < 1 or t.shape[0] < page_size:
        raise ValueError(f"{what}: page_size must be >= 1 and <= the token count")
    bases = tuple((x.buffer, x.offset) for x in tensors)
    return LayoutDescriptor(len(tensors) // planes, planes, t.shape[0] // page_size, page_size,
                            _row_bytes(t, 2), page_size * t.strides[0], t.strides[0], bases)


def sglang_mha(k_layers: list[TensorRef], v_layers: list[TensorRef], page_size: int) -> LayoutDescriptor:
    """SGLang MHA token pool: K and V per layer ``[num_tokens, kv_heads, head_dim]``.

    A page is ``page_size`` consecutive token slots; page id = slot // page_size.
    """
    if len(k_layers) != len(v_layers):
        raise ValueError("sglang_mha: as many V tensors as K tensors are needed")
    interleaved = [t for pair in zip(k_layers, v_layers) for t in pair]
    return _token_pool(interleaved, page_size, 2, "sglang_mha")


def sglang_mla(layers: list[TensorRef], page_size: int) -> LayoutDescriptor:
    """SGLang MLA token pool: per layer ``[num_tokens, 1, kv_lora_rank + rope_dim]``."""
    if layers and layers[0].shape[1:2] != (1,):
        raise ValueError("sglang_mla: dim 1 must be 1")
    return _token_pool(layers, page_size, 1, "sglang_mla")


def page_first(pool: TensorRef) -> LayoutDescriptor:
    """One tensor ``[num_pages, layers, 2, page_size, kv_heads, head_dim]``."""
    _check_rank(pool, 6, "page_first")
    if pool.shape[2] != 2:
        raise ValueError("page_first: dim 2 must be 2 (K, V)")
    bases = tuple((pool.buffer, pool.offset + layer * pool.strides[1] + p * pool.strides[2])
                  for layer in range(pool.shape[1]) for p in (0, 1))
    return LayoutDescriptor(pool.shape[1], 2, pool.shape[0], pool.shape[3], _row_bytes(pool, 2),
                            pool.strides[0], pool.strides[3], bases)


def _dense_bytes(t: TensorRef, what: str) -> int:
    """Bytes of dims 1.. of ``t``, which must fill one dense range (in any dim order)."""
    dims = sorted((s, n) for n, s in zip(t.shape[1:], t.strides[1:]) if n > 1)
    expect = t.itemsize
    for stride, n in dims:
        if stride != expect:
            raise ValueError(f"{what}: a page (dims 1..) must be one dense byte range, got shape "
                             f"{t.shape} with byte strides {t.strides}")
        expect *= n
    return expect


def opaque_pages(layers: list[TensorRef], page_size: int) -> LayoutDescriptor:
    """Per layer ``[num_blocks, ...]`` whose dims after the first fill one dense page of
    ``page_size`` tokens, inner order unknown (vLLM's CPU attention packs K transposed)."""
    _same_geometry(layers, "opaque")
    t = layers[0]
    if len(t.shape) < 2 or len(t.strides) != len(t.shape):
        raise ValueError(f"opaque: expected a tensor of at least 2 dims, got shape {t.shape}")
    page_bytes = _dense_bytes(t, "opaque")
    if page_size < 1 or page_bytes % page_size:
        raise ValueError(f"opaque: page_size {page_size} must divide the page's {page_bytes} bytes")
    if t.shape[0] > 1 and t.strides[0] < page_bytes:
        raise ValueError(f"opaque: pages overlap (stride {t.strides[0]} < {page_bytes} bytes)")
    row = page_bytes // page_size
    bases = tuple((x.buffer, x.offset) for x in layers)
    return LayoutDescriptor(len(layers), 1, t.shape[0], page_size, row, t.strides[0], row, bases)


LAYOUTS = ("vllm_flash_attn", "vllm_flashinfer", "vllm_mla", "vllm_kv_blocks", "sglang_mha",
           "sglang_mla", "page_first", "opaque")


def describe(name: str, refs: list[TensorRef], page_size: int | None = None) -> LayoutDescriptor:
    """Descriptor of a layout by name. ``refs``: one per layer; for ``sglang_mha``
    K and V interleaved (k0, v0, k1, v1, ...); for ``page_first`` the one pool tensor.
    Token pools (``sglang_*``) and ``opaque`` pages need ``page_size``; ``vllm_kv_blocks``
    takes the head size from the last dim (half of it)."""
    if name == "opaque":
        if not page_size:
            raise ValueError("opaque needs page_size (tokens per page)")
        return opaque_pages(refs, page_size)
    if name in ("sglang_mha", "sglang_mla"):
        if not page_size:
            raise ValueError(f"{name} needs page_size (token slots per page)")
        if name == "sglang_mha":
            return sglang_mha(refs[0::2], refs[1::2], page_size)
        return sglang_mla(refs, page_size)
    if name == "vllm_kv_blocks":
        last = refs[0].shape[-1] if refs and refs[0].shape else 0
        return vllm_kv_blocks(refs, last // 2)
    if name == "page_first":
        if len(refs) != 1:
            raise ValueError("page_first takes exactly one pool tensor")
        return page_first(refs[0])
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    return {"vllm_flash_attn": vllm_flash_attn, "vllm_flashinfer": vllm_flashinfer,
            "vllm_mla": vllm_mla}[name](refs)
