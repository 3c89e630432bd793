"""kvd.copy.host_ops against a row-by-row reference: gather and scatter of many chunks at
shard offsets of any alignment, with every engine layout (vLLM's GPU blocks, whose rows are
head-strided, in both block orders), page order and layer range."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from vllm_blocks import VllmBlocksPool

from kvd.copy import host_ops
from kvd.copy.plan import SKIP_PAGE
from kvd_client.pool import SharedKVPool
from kvd_protocol import layout as L


def reference_row(buffers, d: L.LayoutDescriptor, layer, plane, page, token) -> np.ndarray:
    """The row by the descriptor's rule: its pieces, head after head."""
    buf, off = d.base(layer, plane)
    start = off + page * d.page_stride + token * d.token_stride
    starts = [start + h * d.head_stride for h in range(d.heads)]
    return np.concatenate([buffers[buf][at:at + d.piece_bytes] for at in starts])


def canonical(d, chunk, layer, plane, token) -> int:
    """Byte offset of a row inside a canonical shard (docs/protocol.md §9)."""
    return ((layer * d.planes + plane) * chunk + token) * d.row_bytes


@pytest.fixture(params=["vllm_flash_attn", "vllm_flashinfer", "vllm_mla", "vllm_kv_blocks",
                        "vllm_kv_blocks-NHC", "sglang_mha", "sglang_mla", "page_first"])
def pool(request, tmp_path):
    heads = 1 if request.param.endswith("mla") else 2
    if request.param == "vllm_kv_blocks-NHC":  # tokens outer (SharedKVPool's blocks are HNC)
        p = VllmBlocksPool("NHC", 3, 24, 4, heads, 6, dtype="float16", shm_dir=str(tmp_path))
    else:
        p = SharedKVPool(request.param, num_layers=3, num_pages=24, page_size=4, kv_heads=heads,
                         head_dim=6, dtype="float16", shm_dir=str(tmp_path))
    p.raw[:] = np.random.default_rng(5).integers(0, 256, p.raw.size, dtype=np.uint8)
    yield p
    p.close()


@pytest.mark.parametrize("align", [256, 8, 1], ids=["aligned", "align-8", "unaligned"])
@pytest.mark.parametrize("n", [2, 5], ids=["2-chunks", "5-chunks"])
@pytest.mark.parametrize("block", [host_ops.BLOCK_BYTES, 1], ids=["1MiB-copies", "chunk-copies"])
@pytest.mark.parametrize("bases", ["as-made", "layers-reversed"])
@pytest.mark.parametrize("page_copy", [0, 1 << 62], ids=["by-page", "by-layer"])
def test_gather_then_scatter_match_the_reference(pool, align, n, block, bases, page_copy, monkeypatch):
    """Every path: page by page through a view of the whole pool (pages large enough, bases
    evenly spaced) or per (layer, plane) (small pages, or bases not evenly spaced), in one or
    several blocks."""
    monkeypatch.setattr(host_ops, "BLOCK_BYTES", block)
    monkeypatch.setattr(host_ops, "PAGE_COPY_MIN", page_copy)
    d, chunk = pool.descriptor, 8  # two pages per chunk
    if bases == "layers-reversed":
        order = [b for layer in reversed(range(d.num_layers))
                 for b in d.bases[layer * d.planes:(layer + 1) * d.planes]]
        d = replace(d, bases=tuple(order))
        assert host_ops.pool_view([pool.raw], d) is None
    else:
        assert host_ops.pool_view([pool.raw], d) is not None
    shard = d.shard_bytes(chunk)
    rng = np.random.default_rng(align)
    arena = np.zeros(align * 3 + (n + 2) * (shard + align), np.uint8)
    slots = rng.permutation(n + 2)[:n]
    offsets = [int(s) * (shard + align) + align * (i % 3) for i, s in enumerate(slots)]
    pages = rng.permutation(d.num_pages)[:n * 2].astype(np.int64)
    host_ops.gather([pool.raw], arena, d, chunk, pages, offsets)
    for c, off in enumerate(offsets):
        for layer in range(d.num_layers):
            for plane in range(d.planes):
                for t in range(chunk):
                    want = reference_row([pool.raw], d, layer, plane, pages[c * 2 + t // 4], t % 4)
                    at = off + canonical(d, chunk, layer, plane, t)
                    assert (arena[at:at + d.row_bytes] == want).all(), (c, layer, plane, t)
    before = pool.raw.copy()
    dest = rng.permutation(d.num_pages)[:n * 2].astype(np.int64)
    host_ops.scatter([pool.raw], arena, d, chunk, dest, offsets, layers=range(1, 3))
    for c in range(n):
        for layer in range(d.num_layers):
            for plane in range(d.planes):
                for t in range(chunk):
                    got = reference_row([pool.raw], d, layer, plane, dest[c * 2 + t // 4], t % 4)
                    if layer == 0:  # outside the layer range: untouched
                        want = reference_row([before], d, layer, plane, dest[c * 2 + t // 4], t % 4)
                    else:
                        want = reference_row([before], d, layer, plane, pages[c * 2 + t // 4],
                                             t % 4)
                    assert (got == want).all(), (c, layer, plane, t)


def test_an_empty_request_touches_nothing(pool):
    arena = np.zeros(4096, np.uint8)
    before = pool.raw.copy()
    host_ops.gather([pool.raw], arena, pool.descriptor, 8, np.zeros(0, np.int64), [])
    host_ops.scatter([pool.raw], arena, pool.descriptor, 8, np.zeros(0, np.int64), [])
    assert not arena.any() and (pool.raw == before).all()


@pytest.mark.parametrize("page_copy", [0, 1 << 62], ids=["by-page", "by-layer"])
def test_a_scatter_leaves_skipped_pages_and_every_other_page_alone(pool, page_copy, monkeypatch):
    monkeypatch.setattr(host_ops, "PAGE_COPY_MIN", page_copy)
    d, chunk = pool.descriptor, 8
    shard = d.shard_bytes(chunk)
    arena = np.random.default_rng(9).integers(0, 256, 2 * shard, dtype=np.uint8)
    before = pool.raw.copy()
    dest = np.array([3, SKIP_PAGE, 7, 11], np.int64)  # a partial load leaves out its second page
    host_ops.scatter([pool.raw], arena, d, chunk, dest, [0, shard])
    for page in range(d.num_pages):
        for layer in range(d.num_layers):
            for plane in range(d.planes):
                for t in range(d.page_size):
                    got = reference_row([pool.raw], d, layer, plane, page, t)
                    if page in (3, 7, 11):
                        i = list(dest).index(page)
                        tok = (i % 2) * d.page_size + t
                        at = (i // 2) * shard + canonical(d, chunk, layer, plane, tok)
                        want = arena[at:at + d.row_bytes]
                    else:
                        want = reference_row([before], d, layer, plane, page, t)
                    assert (got == want).all(), (page, layer, plane, t)
