"""Layout descriptors of kvd_protocol.layout: every engine layout addresses the right rows."""

from __future__ import annotations

import numpy as np
import pytest

from kvd_protocol import layout as L

ITEM = 2  # float16


class Pool:
    """Tensors placed inside one random uint8 buffer, like a registered shm file."""

    def __init__(self, shapes, seed=0):
        sizes = [int(np.prod(s)) * ITEM for s in shapes]
        self.offsets = list(np.cumsum([0] + [s + 64 for s in sizes])[:-1])  # 64-byte gaps
        self.raw = np.random.default_rng(seed).integers(0, 256, sum(sizes) + 64 * len(sizes),
                                                        dtype=np.uint8)
        self.tensors = [self.raw[o:o + n].view(np.float16).reshape(s)
                        for o, n, s in zip(self.offsets, sizes, shapes)]
        self.refs = [L.TensorRef(0, int(o), tuple(s), t.strides, ITEM)
                     for o, s, t in zip(self.offsets, shapes, self.tensors)]

    def row(self, d: L.LayoutDescriptor, layer, plane, page, token) -> bytes:
        """The row by the descriptor's rule: its ``heads`` pieces, in head order."""
        buf, off = d.base(layer, plane)
        assert buf == 0
        start = off + page * d.page_stride + token * d.token_stride
        starts = [start + h * d.head_stride for h in range(d.heads)]
        return b"".join(self.raw[at:at + d.piece_bytes].tobytes() for at in starts)


def _check_every_row(pool: Pool, d: L.LayoutDescriptor, expect):
    """expect(layer, plane, page, token) -> the numpy row the descriptor must address."""
    d.validate_extent([pool.raw.size])
    for layer in range(d.num_layers):
        for plane in range(d.planes):
            for page in range(d.num_pages):
                for token in range(d.page_size):
                    want = np.ascontiguousarray(expect(layer, plane, page, token)).tobytes()
                    assert len(want) == d.row_bytes
                    assert pool.row(d, layer, plane, page, token) == want, (layer, plane, page, token)


LAYERS, PAGES_N, PS, HEADS, DIM = 3, 5, 4, 2, 8


def test_vllm_flash_attn():
    pool = Pool([(2, PAGES_N, PS, HEADS, DIM)] * LAYERS)
    d = L.vllm_flash_attn(pool.refs)
    s = pool.tensors[0].strides
    assert (d.num_layers, d.planes, d.num_pages, d.page_size) == (LAYERS, 2, PAGES_N, PS)
    assert (d.row_bytes, d.page_stride, d.token_stride) == (HEADS * DIM * ITEM, s[1], s[2])
    assert d.bases[1] == (0, pool.offsets[0] + s[0]) and d.bases[2] == (0, pool.offsets[1])
    _check_every_row(pool, d, lambda l, p, g, t: pool.tensors[l][p, g, t])


def test_vllm_flashinfer():
    pool = Pool([(PAGES_N, 2, PS, HEADS, DIM)] * LAYERS, seed=1)
    d = L.vllm_flashinfer(pool.refs)
    s = pool.tensors[0].strides
    assert (d.planes, d.num_pages, d.page_size, d.page_stride, d.token_stride) == \
        (2, PAGES_N, PS, s[0], s[2])
    assert d.bases[:2] == ((0, pool.offsets[0]), (0, pool.offsets[0] + s[1]))
    _check_every_row(pool, d, lambda l, p, g, t: pool.tensors[l][g, p, t])


def test_vllm_mla():
    pool = Pool([(PAGES_N, PS, 24)] * LAYERS, seed=2)
    d = L.vllm_mla(pool.refs)
    assert (d.planes, d.num_pages, d.page_size, d.row_bytes) == (1, PAGES_N, PS, 24 * ITEM)
    assert d.bases == tuple((0, o) for o in pool.offsets)
    _check_every_row(pool, d, lambda l, p, g, t: pool.tensors[l][g, t])


def test_sglang_mha():
    tokens = PAGES_N * PS + 3  # a partial last page is left unused
    pool = Pool([(tokens, HEADS, DIM)] * (2 * LAYERS), seed=3)
    k, v = pool.tensors[0::2], pool.tensors[1::2]
    d = L.sglang_mha(pool.refs[0::2], pool.refs[1::2], PS)
    s = pool.tensors[0].strides
    assert (d.planes, d.num_pages, d.page_size) == (2, PAGES_N, PS)
    assert (d.page_stride, d.token_stride) == (PS * s[0], s[0])
    assert d.bases == tuple((0, o) for o in pool.offsets)  # K0, V0, K1, V1, ...
    _check_every_row(pool, d, lambda l, p, g, t: (k, v)[p][l][g * PS + t])


def test_sglang_mla():
    pool = Pool([(PAGES_N * PS, 1, 24)] * LAYERS, seed=4)
    d = L.sglang_mla(pool.refs, PS)
    assert (d.planes, d.num_pages, d.row_bytes, d.page_stride) == (1, PAGES_N, 48, PS * 48)
    _check_every_row(pool, d, lambda l, p, g, t: pool.tensors[l][g * PS + t])


def test_page_first():
    pool = Pool([(PAGES_N, LAYERS, 2, PS, HEADS, DIM)], seed=5)
    d = L.page_first(pool.refs[0])
    s = pool.tensors[0].strides
    assert (d.num_layers, d.planes, d.num_pages, d.page_size) == (LAYERS, 2, PAGES_N, PS)
    assert (d.page_stride, d.token_stride) == (s[0], s[3])
    assert d.bases[3] == (0, pool.offsets[0] + 1 * s[1] + 1 * s[2])
    _check_every_row(pool, d, lambda l, p, g, t: pool.tensors[0][g, l, p, t])


def _blocks(order: str, layers=LAYERS, heads=HEADS, seed=7) -> tuple[Pool, list]:
    """vLLM GPU blocks: per layer logical [blocks, heads, block_size, 2 * DIM], stored
    heads outer (HNC) or tokens outer (NHC); (pool, logical views, refs of them)."""
    hnc = order == "HNC"
    phys = (PAGES_N, heads, PS, 2 * DIM) if hnc else (PAGES_N, PS, heads, 2 * DIM)
    pool = Pool([phys] * layers, seed=seed)
    views = [t if hnc else t.transpose(0, 2, 1, 3) for t in pool.tensors]
    refs = [L.TensorRef(0, int(o), v.shape, v.strides, ITEM) for o, v in zip(pool.offsets, views)]
    return pool, views, refs


@pytest.mark.parametrize("order", ["HNC", "NHC"])
def test_vllm_kv_blocks_rows_are_the_heads_halves(order):
    pool, views, refs = _blocks(order)
    d = L.vllm_kv_blocks(refs, DIM)
    s = views[0].strides
    assert (d.num_layers, d.planes, d.num_pages, d.page_size) == (LAYERS, 2, PAGES_N, PS)
    assert (d.row_bytes, d.heads, d.piece_bytes) == (HEADS * DIM * ITEM, HEADS, DIM * ITEM)
    assert (d.page_stride, d.head_stride, d.token_stride) == (s[0], s[1], s[2])
    assert d.bases[:2] == ((0, pool.offsets[0]), (0, pool.offsets[0] + DIM * ITEM))
    # K: every head's first DIM elements of the token, V: the second DIM, heads in order
    _check_every_row(pool, d, lambda l, p, g, t: views[l][g, :, t, p * DIM:(p + 1) * DIM])
    # the V plane of the last layer ends at the last byte of its tensor
    end = pool.offsets[-1] + PAGES_N * HEADS * PS * 2 * DIM * ITEM
    assert d.bases[-1][1] + d.plane_span() == end
    with pytest.raises(ValueError):
        d.validate_extent([end - 1])
    assert L.describe("vllm_kv_blocks", refs) == d


def test_vllm_kv_blocks_one_head_is_a_contiguous_row():
    pool, views, refs = _blocks("NHC", heads=1)
    d = L.vllm_kv_blocks(refs, DIM)
    assert (d.heads, d.head_stride, d.row_bytes) == (1, 0, DIM * ITEM)
    _check_every_row(pool, d, lambda l, p, g, t: views[l][g, 0, t, p * DIM:(p + 1) * DIM])


def test_vllm_kv_blocks_of_interleaved_layers():
    # BLHNC: blocks outermost, every layer's block inside: per-layer views stride past layers
    pool = Pool([(PAGES_N, LAYERS, HEADS, PS, 2 * DIM)], seed=8)
    whole = pool.tensors[0]
    views = [whole[:, layer] for layer in range(LAYERS)]
    refs = [L.TensorRef(0, layer * whole.strides[1], v.shape, v.strides, ITEM)
            for layer, v in enumerate(views)]
    d = L.vllm_kv_blocks(refs, DIM)
    assert d.page_stride == whole.strides[0] and d.bases[2] == (0, whole.strides[1])
    _check_every_row(pool, d, lambda l, p, g, t: views[l][g, :, t, p * DIM:(p + 1) * DIM])


@pytest.mark.parametrize("build", [
    lambda: L.vllm_kv_blocks([], DIM),
    lambda: L.vllm_kv_blocks([_ref((4, 2, 4, 2, 16))], 8),                 # rank
    lambda: L.vllm_kv_blocks([_ref((4, 2, 4, 16))], 4),                    # 16 != 2 x 4
    lambda: L.vllm_kv_blocks([_ref((4, 2, 4, 16))], 0),
    lambda: L.vllm_kv_blocks([L.TensorRef(0, 0, (4, 2, 4, 16), (512, 256, 64, 4), 2)], 8),
    lambda: L.vllm_kv_blocks([_ref((4, 2, 4, 16)), _ref((4, 3, 4, 16))], 8),  # mixed
    lambda: L.vllm_kv_blocks([_ref((4, 257, 1, 2))], 1),                  # heads over the cap
    lambda: L.describe("vllm_kv_blocks", [_ref((4, 2, 4, 15))]),           # odd last dim
], ids=["empty", "rank", "head-size", "zero-head-size", "strided-last-dim", "mixed",
        "too-many-heads", "describe-odd"])
def test_vllm_kv_blocks_invalid(build):
    with pytest.raises(ValueError):
        build()


def test_opaque_pages_move_whole_pages():
    # vLLM CPU: per layer [blocks, heads, block_size, 2 * head_dim]; the rows of a page are
    # its consecutive page_bytes / page_size slices, so all rows of a page are the page
    pool = Pool([(PAGES_N, HEADS, PS, 2 * DIM)] * LAYERS, seed=6)
    d = L.opaque_pages(pool.refs, PS)
    page = HEADS * PS * 2 * DIM * ITEM
    assert (d.num_layers, d.planes, d.num_pages, d.page_size) == (LAYERS, 1, PAGES_N, PS)
    assert (d.row_bytes, d.page_stride, d.token_stride) == (page // PS, page, page // PS)
    for layer in range(LAYERS):
        for g in range(PAGES_N):
            rows = b"".join(pool.row(d, layer, 0, g, t) for t in range(PS))
            assert rows == pool.tensors[layer][g].tobytes()
    d.validate_extent([pool.raw.size])


def test_opaque_pages_any_dense_inner_order_and_strided_blocks():
    # HND viewed as [blocks, tokens, heads, dim] (permuted inner dims) is still one dense page
    raw = np.empty((PAGES_N, HEADS, PS, DIM), dtype=np.float16).transpose(0, 2, 1, 3)
    d = L.opaque_pages([L.TensorRef(0, 0, raw.shape, raw.strides, 2)], PS)
    assert d.row_bytes == HEADS * DIM * 2 and d.page_stride == HEADS * PS * DIM * 2
    # blocks of all layers interleaved (block-outer): the page stride spans the layers
    outer = np.empty((PAGES_N, LAYERS, HEADS, PS, DIM), dtype=np.float16)
    refs = [L.TensorRef(0, layer * outer.strides[1], outer[:, layer].shape, outer[:, layer].strides, 2)
            for layer in range(LAYERS)]
    d = L.opaque_pages(refs, PS)
    assert d.page_stride == outer.strides[0] and d.bases[1] == (0, outer.strides[1])


@pytest.mark.parametrize("build", [
    lambda: L.opaque_pages([_ref((4, 2, 4, 16))], 3),                        # 3 does not divide
    lambda: L.opaque_pages([_ref((4, 2, 4, 16))], 0),
    lambda: L.opaque_pages([_ref((4,))], 4),                                 # no page dims
    lambda: L.opaque_pages([L.TensorRef(0, 0, (4, 2, 4, 8), (512, 256, 32, 2), 2)], 4),  # gaps
    lambda: L.opaque_pages([L.TensorRef(0, 0, (4, 2, 4, 16), (64, 128, 32, 2), 2)], 4),  # overlap
    lambda: L.describe("opaque", [_ref((4, 2, 4, 16))]),                     # no page_size
], ids=["indivisible", "zero", "rank", "gaps", "overlap", "describe-no-page-size"])
def test_opaque_pages_invalid(build):
    with pytest.raises(ValueError):
        build()


def test_tensor_in_other_buffer_and_offset():
    ref = L.TensorRef(3, 4096, (2, 4, 2, 1, 8), (64 * 2, 16 * 2, 8 * 2, 8 * 2, 2), 2)
    d = L.vllm_flash_attn([ref])
    assert d.bases == ((3, 4096), (3, 4096 + 128))
    assert d.row_bytes == 16


def test_layout_names():
    assert set(L.LAYOUTS) == {"vllm_flash_attn", "vllm_flashinfer", "vllm_mla", "vllm_kv_blocks",
                              "sglang_mha", "sglang_mla", "page_first", "opaque"}
    assert all(callable(getattr(L, name)) for name in L.LAYOUTS if name != "opaque")
    assert callable(L.opaque_pages)


def test_describe_by_name():
    pool = Pool([(2, PAGES_N, PS, HEADS, DIM)] * LAYERS)
    assert L.describe("vllm_flash_attn", pool.refs) == L.vllm_flash_attn(pool.refs)
    tok = Pool([(PAGES_N * PS, HEADS, DIM)] * (2 * LAYERS))
    assert L.describe("sglang_mha", tok.refs, PS) == L.sglang_mha(tok.refs[0::2], tok.refs[1::2], PS)
    with pytest.raises(ValueError, match="page_size"):
        L.describe("sglang_mha", tok.refs)
    pf = Pool([(PAGES_N, LAYERS, 2, PS, HEADS, DIM)])
    assert L.describe("page_first", pf.refs) == L.page_first(pf.refs[0])
    with pytest.raises(ValueError):
        L.describe("page_first", pf.refs * 2)
    with pytest.raises(ValueError, match="unknown layout"):
        L.describe("tensorrt_llm", pool.refs)
    cpu = Pool([(PAGES_N, HEADS, PS, 2 * DIM)])
    assert L.describe("opaque", cpu.refs, PS) == L.opaque_pages(cpu.refs, PS)


def _ref(shape, buffer=0, offset=0):
    t = np.empty(shape, dtype=np.float16)
    return L.TensorRef(buffer, offset, tuple(shape), t.strides, 2)


@pytest.mark.parametrize("build", [
    lambda: L.vllm_flash_attn([]),
    lambda: L.vllm_flash_attn([_ref((3, 4, 4, 2, 8))]),
    lambda: L.vllm_flash_attn([_ref((4, 4, 2, 8))]),
    lambda: L.vllm_flash_attn([_ref((2, 4, 4, 2, 8)), _ref((2, 5, 4, 2, 8))]),
    lambda: L.vllm_flashinfer([_ref((4, 3, 4, 2, 8))]),
    lambda: L.vllm_flashinfer([_ref((4, 2, 4, 16))]),
    lambda: L.vllm_mla([_ref((4, 4, 2, 8))]),
    lambda: L.vllm_mla([_ref((0, 4, 8))]),
    lambda: L.sglang_mha([_ref((16, 2, 8))], [], 4),
    lambda: L.sglang_mha([_ref((16, 2, 8))], [_ref((16, 4, 8))], 4),
    lambda: L.sglang_mha([_ref((16, 2, 8))], [_ref((16, 2, 8))], 32),
    lambda: L.sglang_mha([_ref((16, 2, 8))], [_ref((16, 2, 8))], 0),
    lambda: L.sglang_mha([], [], 4),
    lambda: L.sglang_mla([_ref((16, 2, 8))], 4),
    lambda: L.sglang_mla([_ref((16, 8))], 4),
    lambda: L.page_first(_ref((4, 2, 3, 4, 2, 8))),
    lambda: L.page_first(_ref((4, 2, 2, 4, 2))),
    lambda: L.page_first(_ref((4, 0, 2, 4, 2, 8))),
    lambda: L.page_first(_ref((4, 1025, 2, 1, 1, 1))),
], ids=["fa-empty", "fa-dim0", "fa-rank", "fa-mixed", "fi-dim1", "fi-rank", "mla-rank",
        "mla-no-pages", "sg-kv-count", "sg-kv-shape", "sg-page-too-big", "sg-page-0", "sg-empty",
        "sgmla-dim1", "sgmla-rank", "pf-dim2", "pf-rank", "pf-no-layers", "pf-too-many-layers"])
def test_invalid_shapes_raise_value_error(build):
    with pytest.raises(ValueError):
        build()


def test_non_contiguous_rows_raise_value_error():
    # an HND tensor [2, blocks, heads, block, dim] viewed as NHD: heads x dim not contiguous
    hnd = np.empty((2, 4, 2, 4, 8), dtype=np.float16).transpose(0, 1, 3, 2, 4)
    with pytest.raises(ValueError, match="contiguous"):
        L.vllm_flash_attn([L.TensorRef(0, 0, hnd.shape, hnd.strides, 2)])
    # a strided last dim is not contiguous either
    strided = np.empty((4, 4, 32), dtype=np.float16)[:, :, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        L.vllm_mla([L.TensorRef(0, 0, strided.shape, strided.strides, 2)])
    # ...but padding after each row is fine (the row itself is contiguous)
    padded = np.empty((4, 4, 32), dtype=np.float16)[:, :, :24]
    d = L.vllm_mla([L.TensorRef(0, 0, padded.shape, padded.strides, 2)])
    assert (d.row_bytes, d.token_stride, d.page_stride) == (48, 64, 256)
    # ...but padding between tokens (outer dims) is fine
    gap = np.empty((16, 2, 16), dtype=np.float16)[:, :, :8][:, :1, :]
    d = L.sglang_mla([L.TensorRef(0, 0, gap.shape, gap.strides, 2)], 4)
    assert d.row_bytes == 16 and d.token_stride == 64


@pytest.mark.parametrize("kw", [
    {"planes": 3}, {"planes": 0}, {"num_layers": 0}, {"num_pages": 0}, {"page_size": 0},
    {"row_bytes": 0}, {"page_stride": -1}, {"token_stride": -1}, {"bases": ((0, 0),) * 3},
    {"bases": ((0, -1),) * 4}, {"bases": ((-1, 0),) * 4},
    {"num_layers": 1025, "bases": ((0, 0),) * 2050},
    {"heads": 0}, {"heads": 257, "row_bytes": 257 * 16}, {"heads": 3}, {"heads": 32},
    {"head_stride": -1}, {"head_stride": 2**48 + 1},
])
def test_descriptor_validation(kw):
    base = dict(num_layers=2, planes=2, num_pages=4, page_size=4, row_bytes=16, page_stride=64,
                token_stride=16, bases=((0, 0),) * 4, heads=2, head_stride=32)
    L.LayoutDescriptor(**base)
    with pytest.raises(ValueError):
        L.LayoutDescriptor(**{**base, **kw})


def test_validate_extent_and_shard_bytes():
    d = L.LayoutDescriptor(2, 2, num_pages=4, page_size=4, row_bytes=16, page_stride=100,
                           token_stride=20, bases=((0, 0), (0, 400), (1, 0), (1, 7)))
    span = 3 * 100 + 3 * 20 + 16
    assert d.plane_span() == span
    d.validate_extent([400 + span, 7 + span])  # exact fit
    with pytest.raises(ValueError, match="base 1"):
        d.validate_extent([400 + span - 1, 7 + span])
    with pytest.raises(ValueError, match="base 3"):
        d.validate_extent([400 + span, 7 + span - 1])
    with pytest.raises(ValueError, match="buffer 1"):
        d.validate_extent([10**6])
    assert d.shard_bytes(8) == 2 * 2 * 8 * 16
    assert d.base(1, 1) == (1, 7)
    assert L.CANONICAL_VERSION == 1


def test_plane_span_reaches_the_last_head_piece():
    d = L.LayoutDescriptor(1, 2, num_pages=3, page_size=4, row_bytes=24, page_stride=1000,
                           token_stride=10, bases=((0, 0), (0, 5)), heads=3, head_stride=100)
    span = 2 * 1000 + 3 * 10 + 2 * 100 + 8  # the last piece of the last token of the last page
    assert d.plane_span() == span and d.piece_bytes == 8
    d.validate_extent([5 + span])
    with pytest.raises(ValueError, match="base 1"):
        d.validate_extent([5 + span - 1])
    assert d.shard_bytes(8) == 2 * 8 * 24  # canonical rows stay whole: pieces back to back


def test_constructed_layouts_fit_exactly():
    # the last byte of the last row of each tensor is reachable and inside the buffer
    for shapes, build in [([(2, 5, 4, 2, 8)] * 2, lambda r: L.vllm_flash_attn(r)),
                          ([(5, 2, 4, 2, 8)] * 2, lambda r: L.vllm_flashinfer(r)),
                          ([(5, 4, 24)] * 2, lambda r: L.vllm_mla(r))]:
        pool = Pool(shapes)
        d = build(pool.refs)
        d.validate_extent([pool.raw.size])
        last = pool.offsets[-1] + int(np.prod(shapes[-1])) * ITEM
        with pytest.raises(ValueError):
            d.validate_extent([last - 1])
