"""Partial loads on the CUDA backend, bit-exact, on the fake GPU (tests/fakecuda): runs in CI.

A load whose ``tail_pages`` cut its last chunk (docs/protocol.md) writes that
chunk's first pages only: the kernels skip the rows of the pages past the
tail (``SKIP_PAGE``), the DMA plan leaves them out of its runs. Every copy path
(staged kernels, zero-copy kernels, DMA by thread or by the loop), whole and
layer-wise: the loaded pages hold the stored pages' bytes (read by the
engine's own indexing), and the pages past the tail keep their poison, as
does every other byte of the allocation. A partial entry (``part_tokens``: a
shard of only its rows) stores and loads back exact on every path too.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_fake_gpu_copies import CHUNK, CHUNKS, LAYERS, PATHS, geometry, page_bytes, poison

import kvd_client
from kvd_client import ChunkKeys
from kvd_protocol.keys import part_key


def partial_load(fake_engine, d, layout: str, page_size: int, tail: int, layerwise: bool) -> None:
    heads, dim = geometry(layout)
    ppc = CHUNK // page_size
    pages = 2 * CHUNKS * ppc + 3
    tensors, flat, region = fake_engine.tensors(layout, LAYERS, pages, page_size, heads, dim, 5)
    pool = fake_engine.pool(layout, tensors, page_size)
    rng = np.random.default_rng(tail)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model=f"fake-partial-{layout}")
        tokens = rng.integers(0, 50000, CHUNKS * CHUNK)
        perm = rng.permutation(pages)
        src, dst = perm[:CHUNKS * ppc], perm[CHUNKS * ppc:2 * CHUNKS * ppc]
        n = (CHUNKS - 1) * ppc + tail  # pages the load fills
        expect = [page_bytes(layout, flat, int(p), page_size) for p in src[:n]]
        assert client.store(tokens, src) == CHUNKS * CHUNK
        poison(layout, flat, dst, page_size)
        before = region.array.copy()
        t = client.submit_load(tokens, dst[:n], layerwise=layerwise, tail_pages=tail)
        for layer in range(LAYERS if layerwise else 0):
            client.wait_for_layer(layer, t)
        assert client._blocking(t) == (CHUNKS - 1) * CHUNK + tail * page_size
        if layerwise:
            assert pool.stream.synchronize(timeout=10)
        for p, want in zip(dst[:n], expect):
            assert page_bytes(layout, flat, int(p), page_size) == want, f"page {p}"
        poison(layout, flat, dst[:n], page_size)  # back to poison: nothing else moved
        assert np.array_equal(region.array, before), "a byte past the loaded pages moved"


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("layout", ["vllm_flash_attn", "vllm_mla", "vllm_kv_blocks"])
def test_partial_load_bit_exact_and_nothing_past_its_tail(fake_engine, fake_daemon, path, layout):
    knobs, how = PATHS[path]
    if path.startswith("dma") and layout.startswith("vllm_kv_blocks"):
        how = r"(gather|scatter) of 8 chunks.* staged pieces"
    d = fake_daemon(log_level="debug", **knobs)
    partial_load(fake_engine, d, layout, 4, 3, False)
    partial_load(fake_engine, d, layout, 4, 1, False)
    took = [m.group(1) for m in re.finditer(how, d.log())]
    assert took == ["gather", "scatter"] * 2, f"the copies did not take the {path} path:\n{d.log()}"
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_layerwise_partial_load(fake_engine, fake_daemon, path):
    d = fake_daemon(**PATHS[path][0])
    partial_load(fake_engine, d, "vllm_flash_attn", 8, 1, True)
    assert d.stop() == 0, d.log()


def partial_entry(fake_engine, d, layout: str, page_size: int, pages_in: int, layerwise: bool) -> None:
    """A partial entry of ``pages_in`` pages stored from some pages, loaded into others."""
    heads, dim = geometry(layout)
    pages = 4 * CHUNK // page_size
    tensors, flat, region = fake_engine.tensors(layout, LAYERS, pages, page_size, heads, dim, 9)
    pool = fake_engine.pool(layout, tensors, page_size)
    perm = np.random.default_rng(pages_in).permutation(pages)
    src, dst = perm[:pages_in], perm[pages_in:2 * pages_in]
    n = pages_in * page_size
    key = part_key(b"\x01" * 16, list(range(n)))
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model=f"fake-part-{layout}")
        expect = [page_bytes(layout, flat, int(p), page_size) for p in src]
        assert client._blocking(client.submit_store(ChunkKeys([key]), src, part_tokens=n)) == n
        poison(layout, flat, dst, page_size)
        before = region.array.copy()
        t = client.submit_load(ChunkKeys([key]), dst, layerwise=layerwise, part_tokens=n)
        for layer in range(LAYERS if layerwise else 0):
            client.wait_for_layer(layer, t)
        assert client._blocking(t) == n
        if layerwise:
            assert pool.stream.synchronize(timeout=10)
        for p, want in zip(dst, expect):
            assert page_bytes(layout, flat, int(p), page_size) == want, f"page {p}"
        poison(layout, flat, dst, page_size)
        assert np.array_equal(region.array, before), "a byte past the partial entry's pages moved"


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("layout", ["vllm_flash_attn", "vllm_mla"])
def test_partial_entry_round_trip(fake_engine, fake_daemon, path, layout):
    d = fake_daemon(**PATHS[path][0])
    partial_entry(fake_engine, d, layout, 4, 3, False)
    partial_entry(fake_engine, d, layout, 4, 1, True)
    assert d.stop() == 0, d.log()
