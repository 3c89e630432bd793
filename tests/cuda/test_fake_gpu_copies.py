"""The CUDA backend's copies, bit-exact, on the fake GPU (tests/fakecuda): runs in CI.

A real ``kvd serve --gpu on`` runs kvd.cuda unchanged over the fake GPU
(its ``cupy`` is tests/fakecuda/shim); this process is the engine, its KV
tensors in fake device memory shared with the daemon through (fake) CUDA
IPC. Each case stores chunks from some pages and loads them into others,
through the staged path (kernels into 1 MiB device slots, DMA to the arena:
several pieces per request), the zero-copy path (``gpu_stage_slots = 0``:
kernels on the pinned arena) or the DMA path (``gpu_copy_path = dma``: the
copy engines between pages and arena, no kernel, queued by a thread of each
direction; ``dma_loop``: by the event loop, ``gpu_dma_store_thread`` and
``gpu_dma_load_thread`` off), and checks the target pages against the
source pages read by the engine's own indexing (workers_data.token_row, not
kvd's layout code), and that no other byte of the allocation moved. The
daemon's debug log must name the path the case claims to take (staged:
several pieces each way).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from workers_data import token_row

import kvd_client

CHUNK = 16          # the test daemons' chunk_tokens
CHUNKS = 8          # per request
LAYERS = 8
PATHS = {"staged": ({"gpu_stage_slot_bytes": "1MiB", "gpu_copy_path": "kernels"},
                    r"(gather|scatter) of 8 chunks.* [2-9] staged pieces"),
         "zero_copy": ({"gpu_stage_slots": 0, "gpu_copy_path": "kernels"},
                       r"(gather|scatter) of 8 chunks.* zero-copy kernel"),
         "dma": ({"gpu_copy_path": "dma", "gpu_dma_streams": 3}, r"(gather|scatter) of 8 chunks.* DMA:"),
         "dma_loop": ({"gpu_copy_path": "dma", "gpu_dma_streams": 3, "gpu_dma_store_thread": "false",
                       "gpu_dma_load_thread": "false"},
                        r"(gather|scatter) of 8 chunks.* DMA:")}
POISON = 0xA5


def page_views(layout: str, flat: list, page: int, page_size: int) -> list[np.ndarray]:
    """uint8 views of every row of ``page``: layers x planes x token slots."""
    planes = 1 if layout.endswith("mla") else 2
    return [token_row(layout, flat, layer, plane, page, slot, page_size)
            for layer in range(LAYERS) for plane in range(planes) for slot in range(page_size)]


def page_bytes(layout: str, flat: list, page: int, page_size: int) -> bytes:
    return np.concatenate(page_views(layout, flat, page, page_size)).tobytes()


def poison(layout: str, flat: list, pages, page_size: int) -> None:
    for p in pages:
        for row in page_views(layout, flat, int(p), page_size):
            row[:] = POISON


def geometry(layout: str) -> tuple[int, int]:
    return (1, 576) if layout.endswith("mla") else (8, 128)  # rows of 1152 / 2048 bytes


def store_then_load(fake_engine, d, layout: str, page_size: int, seed: int) -> None:
    heads, dim = geometry(layout)
    ppc = CHUNK // page_size
    pages = 2 * CHUNKS * ppc + 3
    tensors, flat, region = fake_engine.tensors(layout, LAYERS, pages, page_size, heads, dim, seed)
    pool = fake_engine.pool(layout, tensors, page_size)
    rng = np.random.default_rng(seed)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model=f"fake-{layout}-{page_size}")
        tokens = rng.integers(0, 50000, CHUNKS * CHUNK)
        perm = rng.permutation(pages)
        src, dst = perm[:CHUNKS * ppc], perm[CHUNKS * ppc:2 * CHUNKS * ppc]
        expect = [page_bytes(layout, flat, int(p), page_size) for p in src]
        assert client.store(tokens, src) == CHUNKS * CHUNK
        poison(layout, flat, dst, page_size)
        before = region.array.copy()
        assert client.load(tokens, dst) == CHUNKS * CHUNK
        for p, want in zip(dst, expect):
            assert page_bytes(layout, flat, int(p), page_size) == want, f"page {p}"
        poison(layout, flat, dst, page_size)  # the loaded pages back to poison: nothing else moved
        assert np.array_equal(region.array, before)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("layout", ["vllm_flash_attn", "vllm_mla", "vllm_kv_blocks",
                                    "vllm_kv_blocks_nhc"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_then_load_other_pages_bit_exact(fake_engine, fake_daemon, path, layout, page_size):
    knobs, how = PATHS[path]
    if path.startswith("dma") and layout.startswith("vllm_kv_blocks"):  # K|V per head: no page is one
        how = r"(gather|scatter) of 8 chunks.* staged pieces"   # byte range, kernels copy it
    d = fake_daemon(log_level="debug", trace=True, **knobs)
    store_then_load(fake_engine, d, layout, page_size, seed=page_size)
    took = [m.group(1) for m in re.finditer(how, d.log())]
    assert took == ["gather", "scatter"], f"the copies did not take the {path} path:\n{d.log()}"
    if "DMA:" in how:  # who queued the batches: each direction's thread (the default) or the loop
        by = {e["queued_by"] for e in d.trace() if e["ev"] == "dma"}
        assert by == ({"MainThread"} if path == "dma_loop" else {"kvd-dma0", "kvd-dma0-load"}), by
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("path", ["staged", "dma"])
@pytest.mark.parametrize("layout", ["vllm_flashinfer", "sglang_mha", "sglang_mla", "page_first"])
def test_other_layouts(fake_engine, fake_daemon, layout, path):
    knobs, how = PATHS[path]
    d = fake_daemon(log_level="debug", **knobs)
    store_then_load(fake_engine, d, layout, 16, seed=7)
    assert [m.group(1) for m in re.finditer(how, d.log())] == ["gather", "scatter"], d.log()
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("src, dst", [("vllm_kv_blocks", "vllm_kv_blocks_nhc"),
                                      ("vllm_kv_blocks_nhc", "vllm_kv_blocks"),
                                      ("vllm_kv_blocks_nhc", "vllm_flash_attn"),
                                      ("vllm_flash_attn", "vllm_kv_blocks")])
def test_vllm_gpu_blocks_share_chunks_with_other_layouts(fake_engine, fake_daemon, src, dst):
    """vLLM's GPU blocks (head-strided rows, heads or tokens outer) and flash-attn pools of
    one model: a chunk one stores is the other's hit, every token row byte for byte, and
    the load writes nothing but the target pages."""
    d = fake_daemon(gpu_stage_slot_bytes="1MiB")
    heads, dim = geometry(src)
    ps, pages = 16, 2 * CHUNKS + 3
    a_tensors, a_flat, _ = fake_engine.tensors(src, LAYERS, pages, ps, heads, dim, seed=11)
    b_tensors, b_flat, b_region = fake_engine.tensors(dst, LAYERS, pages, ps, heads, dim, seed=12)
    rng = np.random.default_rng(13)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        a = client.register_kv(fake_engine.pool(src, a_tensors, ps), model="fake-shared-mha")
        b = client.register_kv(fake_engine.pool(dst, b_tensors, ps), model="fake-shared-mha")
        assert a.namespace == b.namespace
        tokens = rng.integers(0, 50000, CHUNKS * CHUNK)
        src_pages, dst_pages = rng.permutation(pages)[:CHUNKS], rng.permutation(pages)[:CHUNKS]
        expect = [page_bytes(src, a_flat, int(p), ps) for p in src_pages]
        assert client.store(tokens, src_pages, reg=a) == CHUNKS * CHUNK
        poison(dst, b_flat, dst_pages, ps)
        before = b_region.array.copy()
        assert client.load(tokens, dst_pages, reg=b) == CHUNKS * CHUNK
        for p, want in zip(dst_pages, expect):
            assert page_bytes(dst, b_flat, int(p), ps) == want, f"page {p}"
        poison(dst, b_flat, dst_pages, ps)
        assert np.array_equal(b_region.array, before)
    assert d.stop() == 0, d.log()


def test_pinning_that_fails_midway_is_undone_and_the_next_registration_pins_it_all(
        fake_engine, fake_daemon):
    """The host tier is pinned in 1 GiB pieces at the first registration: when the second
    piece fails, the first is unpinned again, the engine hears a daemon fault (``internal``,
    not its own ``bad_request``), and the next registration pins the whole tier (no
    "already registered") and copies bit-exact."""
    d = fake_daemon(fail_host_register=2, host_capacity="1100MiB", gpu_stage_slot_bytes="1MiB")
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", LAYERS, 8, 16, 8, 128, seed=5)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        with pytest.raises(kvd_client.ServerError) as failed:
            client.register_kv(fake_engine.pool("vllm_flash_attn", tensors), model="pinned")
    assert failed.value.code == "internal", failed.value
    assert "cudaErrorMemoryAllocation" in d.log() and "AlreadyRegistered" not in d.log()
    store_then_load(fake_engine, d, "vllm_flash_attn", 16, seed=11)
    assert "host tier pinned for the GPU" in d.log()
    assert d.stop() == 0, d.log()
