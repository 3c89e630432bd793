"""Partial loads on a real GPU: a load that ends inside its last chunk at a page boundary
(``tail_pages``, docs/protocol.md) writes that chunk's first pages only, on every copy path.

Real engine (this process, torch tensors in one allocation as vLLM's), real
``kvd serve --gpu on``: kernels through staging slots, kernels straight on the
pinned arena, DMA straight and DMA staged; a Llama-like and an MLA pool; whole
and layer-wise loads. The loaded pages hold exactly the stored pages, the pages
past the tail keep their poison, and no other byte of the allocation moves.
A partial entry (``part_tokens``: a request's tail, a shard of only its rows)
stores and loads back exact on the same paths.
Skipped without torch, cupy or a GPU.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from gpu_env import require_gpu  # noqa: E402

torch = require_gpu()

import kvd_client  # noqa: E402
from kvd_client import ChunkKeys  # noqa: E402
from kvd_protocol.keys import part_key  # noqa: E402
from kvd.cuda.dma.path import STAGE_IDLE_S  # noqa: E402
from kvd_client.torch_pool import CudaKVPool  # noqa: E402

pytestmark = pytest.mark.gpu
CHUNK, LAYERS, PAGE, CHUNKS = 64, 8, 16, 4
PPC = CHUNK // PAGE
SHAPES = {"vllm_flash_attn": (8, 128), "vllm_mla": (1, 576)}  # heads, head dim (bf16)
BASE = {"chunk_tokens": CHUNK, "host_capacity": "1GiB", "gpu": "on", "log_level": "debug"}
PATHS = {"kernels_staged": {"gpu_copy_path": "kernels", "gpu_stage_slot_bytes": "1MiB"},
         "kernels_zero_copy": {"gpu_copy_path": "kernels", "gpu_stage_slots": 0},
         "dma": {"gpu_copy_path": "dma", "gpu_stage_slot_bytes": "8MiB"},
         "dma_staged": {"gpu_copy_path": "dma", "gpu_stage_slot_bytes": "8MiB",
                        "gpu_dma_stage_below": "64MiB"}}


def pool_views(layout: str, pages: int):
    heads, dim = SHAPES[layout]
    shape = (LAYERS, pages, PAGE, dim * 2) if layout == "vllm_mla" else \
        (LAYERS, 2, pages, PAGE, heads, dim * 2)
    whole = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(torch.bfloat16)
    return whole, list(whole.unbind(0))


def page_of(layout: str, views: list, page: int) -> list:
    return [v[:, page] if layout == "vllm_flash_attn" else v[page] for v in views]


def poison(layout: str, views: list, pages) -> None:
    for p in pages:
        for x in page_of(layout, views, p):
            x.view(torch.uint8).fill_(0xA5)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("layout", sorted(SHAPES))
def test_partial_load_bit_exact_and_nothing_past_its_tail(start_daemon, layout, path):
    d = start_daemon(**BASE, **PATHS[path])
    pages = 2 * CHUNKS * PPC + 3
    whole, views = pool_views(layout, pages)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(CudaKVPool(layout, views, page_size=PAGE), model=f"partial-{layout}")
        for tail, layerwise in ((1, False), (3, True), (2, False)):
            perm = torch.randperm(pages).tolist()
            src, dst = perm[:CHUNKS * PPC], perm[CHUNKS * PPC:2 * CHUNKS * PPC]
            n = (CHUNKS - 1) * PPC + tail
            tokens = np.random.default_rng(tail).integers(0, 50000, CHUNKS * CHUNK)
            expect = [[x.clone() for x in page_of(layout, views, p)] for p in src[:n]]
            torch.cuda.synchronize()
            assert client.store(tokens, src) == CHUNKS * CHUNK
            poison(layout, views, dst)
            before = whole.clone()
            time.sleep(2 * STAGE_IDLE_S)
            t = client.submit_load(tokens, dst[:n], layerwise=layerwise, tail_pages=tail)
            for layer in range(LAYERS if layerwise else 0):
                client.wait_for_layer(layer, t)
            assert client._blocking(t) == (CHUNKS - 1) * CHUNK + tail * PAGE
            torch.cuda.synchronize()
            for p, want in zip(dst[:n], expect):
                got = page_of(layout, views, p)
                assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8))
                           for g, w in zip(got, want)), f"page {p} (tail {tail})"
            poison(layout, views, dst[:n])
            assert torch.equal(whole.view(torch.uint8), before.view(torch.uint8)), \
                f"a byte past the {n} loaded pages moved (tail {tail})"
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("layout", sorted(SHAPES))
def test_partial_entry_round_trip(start_daemon, layout, path):
    d = start_daemon(**BASE, **PATHS[path])
    pages = 4 * PPC
    whole, views = pool_views(layout, pages)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(CudaKVPool(layout, views, page_size=PAGE), model=f"part-{layout}")
        for n_pages, layerwise in ((1, False), (3, True)):
            perm = torch.randperm(pages).tolist()
            src, dst = perm[:n_pages], perm[n_pages:2 * n_pages]
            n = n_pages * PAGE
            key = part_key(bytes([n_pages]) * 16, list(range(n)))
            expect = [[x.clone() for x in page_of(layout, views, p)] for p in src]
            torch.cuda.synchronize()
            assert client._blocking(client.submit_store(ChunkKeys([key]), src, part_tokens=n)) == n
            poison(layout, views, dst)
            before = whole.clone()
            time.sleep(2 * STAGE_IDLE_S)
            t = client.submit_load(ChunkKeys([key]), dst, layerwise=layerwise, part_tokens=n)
            for layer in range(LAYERS if layerwise else 0):
                client.wait_for_layer(layer, t)
            assert client._blocking(t) == n
            torch.cuda.synchronize()
            for p, want in zip(dst, expect):
                got = page_of(layout, views, p)
                assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8))
                           for g, w in zip(got, want)), f"page {p} ({n} tokens)"
            poison(layout, views, dst)
            assert torch.equal(whole.view(torch.uint8), before.view(torch.uint8)), \
                f"a byte past the partial entry's {n_pages} pages moved"
    assert d.stop() == 0, d.log()
