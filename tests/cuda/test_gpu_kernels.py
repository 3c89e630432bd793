"""GPU tests of kernels/kv_copy.cu through kvd.cuda.kernels.KernelCopier.

For every layout constructor of kvd_protocol.layout (vLLM's GPU blocks, whose
rows are head-strided, in both block orders), page sizes 1/16/64, fp16/bf16 and
fp8 rows, MHA and MLA shapes, aligned and misaligned bases: gather random
pages of a random pool into poisoned pinned host memory and compare with a
numpy reference built from the descriptor math; then scatter the shards into
other pages of a poisoned pool, all layers and a layer subrange, and check
every pool byte. vLLM's GPU blocks also move, through canonical shards, into
the other block order and into flash-attn pools, checked against numpy
indexing of the engines' tensors. Skips cleanly without CuPy or a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kvd.cuda.kernels import KernelCopier, desc_params, plane_bases  # noqa: E402
from kvd_protocol import layout as L  # noqa: E402


def _device_count() -> int:
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_device_count() < 1, reason="no CUDA device")]

CHUNK_TOKENS = 128
N_CHUNKS = 3
NUM_LAYERS = 3
# name, kv heads, head dim (latent width for MLA), item size
MHA_SHAPES = [("fp16", 2, 64, 2), ("fp8", 2, 64, 1), ("tiny-fp8", 1, 8, 1), ("odd5", 1, 5, 1)]
MLA_SHAPES = [("bf16-576", 1, 576, 2), ("fp8-576", 1, 576, 1), ("odd5", 1, 5, 1)]
# vLLM's GPU blocks: several heads make head-strided rows (pieces of head_dim elements)
BLOCK_SHAPES = MHA_SHAPES + [("bf16-8x128", 8, 128, 2), ("odd-3x5", 3, 5, 1)]
MLA_LAYOUTS = ("vllm_mla", "sglang_mla")
BLOCK_LAYOUTS = ("vllm_kv_blocks", "vllm_kv_blocks_nhc")  # heads outer, tokens outer
CASES = [(lay, ps, shape, mis)
         for lay in (*L.LAYOUTS, "vllm_kv_blocks_nhc")
         for ps in (1, 16, 64)
         for shape in (MLA_SHAPES if lay in MLA_LAYOUTS else
                       BLOCK_SHAPES if lay in BLOCK_LAYOUTS else MHA_SHAPES)
         for mis in (0, 8, 1)]


class _Alloc:
    """Places contiguous tensors in one byte buffer, gaps between them."""

    def __init__(self, misalign: int) -> None:
        self.end, self.misalign = 0, misalign

    def tensor(self, shape: tuple[int, ...], itemsize: int) -> L.TensorRef:
        strides, acc = [], itemsize
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        off = (self.end + 255) // 256 * 256 + 256 + self.misalign
        self.end = off + acc
        return L.TensorRef(0, off, tuple(shape), tuple(reversed(strides)), itemsize)


def build(lay: str, num_pages: int, ps: int, heads: int, dim: int, it: int,
          misalign: int) -> tuple[L.LayoutDescriptor, int]:
    a, n = _Alloc(misalign), NUM_LAYERS
    if lay == "vllm_flash_attn":
        desc = L.vllm_flash_attn([a.tensor((2, num_pages, ps, heads, dim), it) for _ in range(n)])
    elif lay == "vllm_flashinfer":
        desc = L.vllm_flashinfer([a.tensor((num_pages, 2, ps, heads, dim), it) for _ in range(n)])
    elif lay == "vllm_mla":
        desc = L.vllm_mla([a.tensor((num_pages, ps, dim), it) for _ in range(n)])
    elif lay == "sglang_mha":
        k = [a.tensor((num_pages * ps, heads, dim), it) for _ in range(n)]
        v = [a.tensor((num_pages * ps, heads, dim), it) for _ in range(n)]
        desc = L.sglang_mha(k, v, ps)
    elif lay == "sglang_mla":
        desc = L.sglang_mla([a.tensor((num_pages * ps, 1, dim), it) for _ in range(n)], ps)
    elif lay == "page_first":
        desc = L.page_first(a.tensor((num_pages, n, 2, ps, heads, dim), it))
    elif lay == "opaque":
        desc = L.opaque_pages([a.tensor((num_pages, heads, ps, dim), it) for _ in range(n)], ps)
    elif lay == "vllm_kv_blocks":  # [blocks, heads, block_size, 2 * head_size]
        desc = L.vllm_kv_blocks([a.tensor((num_pages, heads, ps, 2 * dim), it)
                                 for _ in range(n)], dim)
    elif lay == "vllm_kv_blocks_nhc":  # stored [blocks, block_size, heads, 2 * head_size]
        phys = [a.tensor((num_pages, ps, heads, 2 * dim), it) for _ in range(n)]
        desc = L.vllm_kv_blocks([L.TensorRef(r.buffer, r.offset, _swap12(r.shape),
                                             _swap12(r.strides), it) for r in phys], dim)
    else:
        raise AssertionError(lay)
    size = a.end + 512
    desc.validate_extent([size])
    assert desc.num_pages == num_pages and desc.page_size == ps
    return desc, size


def _swap12(dims: tuple) -> tuple:
    return (dims[0], dims[2], dims[1], *dims[3:])


def byte_index(desc: L.LayoutDescriptor, page_ids: np.ndarray, n_chunks: int) -> np.ndarray:
    """Pool byte offsets, shape (chunk, layer, plane, token, row byte), canonical order
    (row byte j: byte j % piece of the row's piece j // piece)."""
    ps, t = desc.page_size, np.arange(CHUNK_TOKENS)
    base = np.array([off for _, off in desc.bases], np.int64).reshape(desc.num_layers, desc.planes)
    pages = np.asarray(page_ids, np.int64).reshape(n_chunks, CHUNK_TOKENS // ps)[:, t // ps]
    within = pages * desc.page_stride + (t % ps) * desc.token_stride            # (chunk, token)
    rows = base[None, :, :, None] + within[:, None, None, :]
    j = np.arange(desc.row_bytes)
    return rows[..., None] + j // desc.piece_bytes * desc.head_stride + j % desc.piece_bytes


def pinned(nbytes: int) -> tuple[object, np.ndarray]:
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    return mem, np.frombuffer(mem, np.uint8, nbytes)


def mismatch(got: np.ndarray, want: np.ndarray) -> str:
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    return f"{bad.size} of {want.size} bytes differ, first at {bad[:5]}"


@pytest.fixture(scope="module")
def copier():
    return KernelCopier(0, max_blocks=8, threads=256, slots=4)


@pytest.mark.parametrize("lay,ps,shape,mis", CASES,
                         ids=[f"{c[0]}-ps{c[1]}-{c[2][0]}-mis{c[3]}" for c in CASES])
def test_gather_scatter(copier, lay, ps, shape, mis):
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    _, heads, dim, it = shape
    ppc = CHUNK_TOKENS // ps
    num_pages = 2 * N_CHUNKS * ppc + 3
    desc, size = build(lay, num_pages, ps, heads, dim, it, mis)
    shard = desc.shard_bytes(CHUNK_TOKENS)
    assert shard == NUM_LAYERS * desc.planes * CHUNK_TOKENS * desc.row_bytes
    stream = cp.cuda.Stream(non_blocking=True)

    pool_host = rng.integers(0, 256, size, dtype=np.uint8)
    pool = cp.asarray(pool_host)
    cp.cuda.runtime.deviceSynchronize()
    bases = plane_bases(desc, [pool.data.ptr])
    params = desc_params(desc)
    perm = rng.permutation(num_pages)
    src_pages, dst_pages = perm[:N_CHUNKS * ppc], perm[N_CHUNKS * ppc:2 * N_CHUNKS * ppc]

    # canonical shards in one pinned region, out of order, gaps between them
    gap = 64
    _mem, host = pinned(N_CHUNKS * (shard + gap) + gap + 16)
    order = rng.permutation(N_CHUNKS)
    offs = [gap + int(order[c]) * (shard + gap) + mis for c in range(N_CHUNKS)]
    ptrs = [host.ctypes.data + o for o in offs]
    inside = np.zeros(host.size, bool)
    for o in offs:
        inside[o:o + shard] = True

    ref = pool_host[byte_index(desc, src_pages, N_CHUNKS)]          # (c, l, p, t, r)
    ref_flat = ref.reshape(N_CHUNKS, shard)
    msg = f"seed={seed}"

    # gather, all layers
    poison = rng.integers(0, 256, host.size, dtype=np.uint8)
    host[:] = poison
    copier.gather(bases, src_pages, ptrs, chunk_tokens=CHUNK_TOKENS, stream=stream, **params)
    plan = dict(copier.last_plan)
    stream.synchronize()
    if mis == 0 and desc.piece_bytes % 16 == 0 and desc.head_stride % 16 == 0:
        assert plan["vec_bytes"] == 16, plan
    if mis == 1:
        assert plan["vec_bytes"] == 1, plan
    for c, o in enumerate(offs):
        assert np.array_equal(host[o:o + shard], ref_flat[c]), f"chunk {c}: " + \
            mismatch(host[o:o + shard], ref_flat[c]) + " " + msg
    assert np.array_equal(host[~inside], poison[~inside]), "gather wrote outside the shards " + msg
    gathered = host.copy()
    assert np.array_equal(cp.asnumpy(pool), pool_host), "gather changed the pool " + msg

    # gather, layer subrange [1, 2)
    host[:] = poison
    copier.gather(bases, src_pages, ptrs, chunk_tokens=CHUNK_TOKENS, stream=stream,
                  layer_begin=1, layer_end=2, **params)
    stream.synchronize()
    want = poison.copy()
    layer_bytes = desc.planes * CHUNK_TOKENS * desc.row_bytes
    for c, o in enumerate(offs):
        want[o + layer_bytes:o + 2 * layer_bytes] = ref_flat[c][layer_bytes:2 * layer_bytes]
    assert np.array_equal(host, want), "subrange gather: " + mismatch(host, want) + " " + msg

    # scatter all layers into other pages of a poisoned pool
    host[:] = gathered
    idx_dst = byte_index(desc, dst_pages, N_CHUNKS)
    for lb, le in ((0, NUM_LAYERS), (1, 2), (NUM_LAYERS - 1, NUM_LAYERS)):
        pool_poison = rng.integers(0, 256, size, dtype=np.uint8)
        pool.set(pool_poison)
        cp.cuda.runtime.deviceSynchronize()
        copier.scatter(bases, dst_pages, ptrs, chunk_tokens=CHUNK_TOKENS, stream=stream,
                       layer_begin=lb, layer_end=le, **params)
        stream.synchronize()
        want = pool_poison.copy()
        want[idx_dst[:, lb:le]] = ref[:, lb:le]
        got = cp.asnumpy(pool)
        assert np.array_equal(got, want), f"scatter [{lb},{le}): " + mismatch(got, want) + " " + msg
    assert np.array_equal(host, gathered), "scatter changed the source shards " + msg


def _layer_refs(t: np.ndarray, item: int) -> list[L.TensorRef]:
    """Per-layer refs of ``t`` ``[layer, ...]`` (any strides) in a buffer starting at ``t``."""
    return [L.TensorRef(0, layer * t.strides[0], t.shape[1:], t.strides[1:], item)
            for layer in range(t.shape[0])]


def _blocks_rows(logical: np.ndarray, pages: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Rows (chunk, token, layer, plane, head, dim) of blocks ``[L, B, H, N, 2 * dim]``."""
    x = logical[:, pages, :, slots]                      # (chunk, token, layer, head, 2 * dim)
    half = x.shape[-1] // 2
    return np.stack([x[..., :half], x[..., half:]], axis=3)


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("item", [2, 1], ids=["bf16", "fp8"])
def test_vllm_gpu_blocks_move_into_the_other_order_and_flash_attn(copier, ps, item):
    """Chunks gathered from heads-outer (HNC) blocks land in tokens-outer (NHC) blocks and in
    a flash-attn pool as the engines' own tensor indexing says, every other byte poisoned."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng, msg = np.random.default_rng(seed), f"seed={seed}"
    heads, dim, dt = 8, 128, np.uint16 if item == 2 else np.uint8
    ppc = CHUNK_TOKENS // ps
    num_pages = 2 * N_CHUNKS * ppc + 3
    size = NUM_LAYERS * num_pages * ps * heads * 2 * dim * item

    def pool_bytes() -> np.ndarray:
        return rng.integers(0, 256, size, dtype=np.uint8)
    hnc_host, nhc_host, fa_host = pool_bytes(), pool_bytes(), pool_bytes()
    hnc = hnc_host.view(dt).reshape(NUM_LAYERS, num_pages, heads, ps, 2 * dim)
    nhc_phys = nhc_host.view(dt).reshape(NUM_LAYERS, num_pages, ps, heads, 2 * dim)
    fa = fa_host.view(dt).reshape(NUM_LAYERS, 2, num_pages, ps, heads, dim)
    descs = {"hnc": L.vllm_kv_blocks(_layer_refs(hnc, item), dim),
             "nhc": L.vllm_kv_blocks(_layer_refs(nhc_phys.transpose(0, 1, 3, 2, 4), item), dim),
             "fa": L.vllm_flash_attn(_layer_refs(fa, item))}
    assert descs["hnc"].heads == descs["nhc"].heads == heads and descs["fa"].heads == 1
    dev = {name: cp.asarray(host) for name, host in
           (("hnc", hnc_host), ("nhc", nhc_host), ("fa", fa_host))}
    cp.cuda.runtime.deviceSynchronize()
    stream = cp.cuda.Stream(non_blocking=True)

    perm = rng.permutation(num_pages)
    src, dst = perm[:N_CHUNKS * ppc], perm[N_CHUNKS * ppc:2 * N_CHUNKS * ppc]
    t = np.arange(CHUNK_TOKENS)
    src_tok, dst_tok = (p.reshape(N_CHUNKS, ppc)[:, t // ps] for p in (src, dst))
    rows = _blocks_rows(hnc, src_tok, t % ps)             # (chunk, token, layer, plane, h, d)

    shard = descs["hnc"].shard_bytes(CHUNK_TOKENS)
    _mem, host = pinned(N_CHUNKS * shard)
    host[:] = 0x5A
    ptrs = [host.ctypes.data + c * shard for c in range(N_CHUNKS)]
    copier.gather(plane_bases(descs["hnc"], [dev["hnc"].data.ptr]), src, ptrs,
                  chunk_tokens=CHUNK_TOKENS, stream=stream, **desc_params(descs["hnc"]))
    stream.synchronize()
    canonical = np.ascontiguousarray(rows.transpose(0, 2, 3, 1, 4, 5)).view(np.uint8)
    assert np.array_equal(host, canonical.reshape(-1)), "gather: " + \
        mismatch(host, canonical.reshape(-1)) + " " + msg

    for name in ("nhc", "fa"):
        copier.scatter(plane_bases(descs[name], [dev[name].data.ptr]), dst, ptrs,
                       chunk_tokens=CHUNK_TOKENS, stream=stream, **desc_params(descs[name]))
    stream.synchronize()
    want_nhc = nhc_host.copy()
    logical = want_nhc.view(dt).reshape(nhc_phys.shape).transpose(0, 1, 3, 2, 4)
    logical[:, dst_tok, :, t % ps, :dim] = rows[:, :, :, 0]
    logical[:, dst_tok, :, t % ps, dim:] = rows[:, :, :, 1]
    want_fa = fa_host.copy()
    for plane in range(2):
        want_fa.view(dt).reshape(fa.shape)[:, plane, dst_tok, t % ps] = \
            rows[:, :, :, plane].transpose(2, 0, 1, 3, 4)
    for name, want in (("nhc", want_nhc), ("fa", want_fa)):
        got = cp.asnumpy(dev[name])
        assert np.array_equal(got, want), f"scatter into {name}: " + mismatch(got, want) + " " + msg
    assert np.array_equal(cp.asnumpy(dev["hnc"]), hnc_host), "gather changed the source " + msg


def test_many_launches_reuse_tables():
    """More launches than staging slots, on two streams, each with its own pages."""
    rng = np.random.default_rng()
    copier = KernelCopier(0, max_blocks=2, threads=64, slots=2)
    desc, size = build("vllm_flash_attn", 64, 16, 2, 64, 2, 0)
    pool_host = rng.integers(0, 256, size, dtype=np.uint8)
    pool = cp.asarray(pool_host)
    cp.cuda.runtime.deviceSynchronize()
    shard = desc.shard_bytes(CHUNK_TOKENS)
    n = 24
    _mem, host = pinned(n * shard)
    host[:] = 0xA5
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    page_sets = [rng.choice(64, CHUNK_TOKENS // 16, replace=False) for _ in range(n)]
    for k in range(n):
        copier.gather(plane_bases(desc, [pool.data.ptr]), page_sets[k],
                      [host.ctypes.data + k * shard], chunk_tokens=CHUNK_TOKENS,
                      stream=streams[k % 2], **desc_params(desc))
    for s in streams:
        s.synchronize()
    for k in range(n):
        want = pool_host[byte_index(desc, page_sets[k], 1)].reshape(-1)
        assert np.array_equal(host[k * shard:(k + 1) * shard], want), f"launch {k}"


def test_device_side_shards_and_checks(copier):
    """chunk_ptrs may be device memory; bad page ids and ranges raise before launch."""
    rng = np.random.default_rng()
    desc, size = build("vllm_mla", 40, 16, 1, 576, 2, 0)
    pool_host = rng.integers(0, 256, size, dtype=np.uint8)
    pool = cp.asarray(pool_host)
    shard = desc.shard_bytes(CHUNK_TOKENS)
    staging = cp.full(2 * shard, 0x3C, dtype=cp.uint8)
    cp.cuda.runtime.deviceSynchronize()
    pages = rng.choice(40, 2 * CHUNK_TOKENS // 16, replace=False)
    bases = plane_bases(desc, [pool.data.ptr])
    ptrs = [staging.data.ptr + shard, staging.data.ptr]
    copier.gather(bases, pages, ptrs, chunk_tokens=CHUNK_TOKENS, **desc_params(desc))
    cp.cuda.runtime.deviceSynchronize()
    ref = pool_host[byte_index(desc, pages, 2)].reshape(2, shard)
    got = cp.asnumpy(staging)
    assert np.array_equal(got[shard:], ref[0]) and np.array_equal(got[:shard], ref[1])
    bad = pages.copy()
    bad[3] = 40
    with pytest.raises(ValueError):
        copier.gather(bases, bad, ptrs, chunk_tokens=CHUNK_TOKENS, **desc_params(desc))
    bad[3] = -1  # SKIP_PAGE: a scatter's way to leave a page alone; never a gather's page
    with pytest.raises(ValueError):
        copier.gather(bases, bad, ptrs, chunk_tokens=CHUNK_TOKENS, **desc_params(desc))
    bad[3] = -2
    with pytest.raises(ValueError):
        copier.scatter(bases, bad, ptrs, chunk_tokens=CHUNK_TOKENS, **desc_params(desc))
    with pytest.raises(ValueError):
        copier.scatter(bases, pages, ptrs, chunk_tokens=CHUNK_TOKENS, layer_begin=2,
                       layer_end=1, **desc_params(desc))
    with pytest.raises(ValueError):
        copier.gather(bases, pages[:-1], ptrs, chunk_tokens=CHUNK_TOKENS, **desc_params(desc))
    # nothing to do: no chunks, empty layer range
    copier.gather(bases, [], [], chunk_tokens=CHUNK_TOKENS, **desc_params(desc))
    copier.scatter(bases, pages, ptrs, chunk_tokens=CHUNK_TOKENS, layer_begin=1,
                   layer_end=1, **desc_params(desc))
    cp.cuda.runtime.deviceSynchronize()
    assert np.array_equal(cp.asnumpy(pool), pool_host)
