"""DMA copies of pools whose layers share one allocation (vLLM's single KV backing
allocation), on a real GPU: real engines, a real daemon, every byte checked.

- Pitched ops straight between the pool and the arena (the default,
  ``gpu_dma_stage_below`` = 0) and staged through the slots (set to 64 KiB:
  pages under it, the other direction idle), for a
  Llama-like and an MLA pool, pages of 1, 16 and 64 tokens, 20 layers, the
  layers' blocks apart (plane-major) or a block's layers adjacent (block-outer):
  poisoned target pages hold exactly the stored pages afterwards, and no
  other byte of the allocation moved; the daemon's log names the path each
  copy took.
- An engine SIGKILLed while its staged load is on the copy engines: the
  daemon reaps it only after the copy, and serves the next engine
  bit-exact, staged.
- Per-layer pools (SGLang's) of 72 KiB pages, one stream a copy, copies queued
  by the loop or by the store thread (``gpu_dma_store_thread``) and the load
  thread (``gpu_dma_load_thread``): bit-exact, and an engine SIGKILLed with its
  stores, or its loads, queued is reaped after them, the daemon unharmed.
Skipped without torch, cupy or a GPU.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from daemons import engine_killed_after, wait_reaped  # noqa: E402
from gpu_env import require_gpu  # noqa: E402

torch = require_gpu()

import kvd_client  # noqa: E402
from kvd.cuda.dma.path import STAGE_IDLE_S  # noqa: E402
from kvd_client.torch_pool import CudaKVPool  # noqa: E402

pytestmark = pytest.mark.gpu
CHUNK, LAYERS = 64, 20
KNOBS = {"chunk_tokens": CHUNK, "host_capacity": "1GiB", "gpu": "on", "gpu_copy_path": "dma",
         "gpu_stage_slot_bytes": "8MiB", "log_level": "debug"}
SHAPES = {"vllm_flash_attn": (8, 128), "vllm_mla": (1, 576)}  # heads, head dim (bf16)


def one_allocation(layout: str, pages: int, page: int, layers: int = LAYERS,
                   block_outer: bool = False):
    """(the whole allocation, the per-layer views the engine registers), random bytes;
    ``block_outer``: the blocks outermost, a block's layers adjacent (vLLM 0.32's BLHNC
    family), so the (layer, plane) planes of a page sit one page apart."""
    heads, dim = SHAPES[layout]
    per_layer = (pages, page, dim * 2) if layout == "vllm_mla" else (2, pages, page, heads, dim * 2)
    axis, shape = (1 if layout == "vllm_mla" else 2), (layers, *per_layer)  # axis: the blocks'
    if block_outer:  # allocated blocks first, viewed in the engine's per-layer order
        shape = (pages, *shape[:axis], *shape[axis + 1:])
    whole = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(torch.bfloat16)
    whole = whole.movedim(0, axis) if block_outer else whole
    return whole, list(whole.unbind(0))


def page_of(layout: str, views: list, page: int) -> list:
    return [v[:, page] if layout == "vllm_flash_attn" else v[page] for v in views]


def path_taken(log: str, chunks: int) -> list:
    return re.findall(rf"(gather|scatter) of {chunks} chunks, [\d.]+ MB, ([a-zA-Z ]+):", log)


@pytest.mark.parametrize("staging,alloc", [("staged", "one"), ("straight", "one"),
                                           ("straight", "block-outer")])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", sorted(SHAPES))
def test_one_allocation_pool_round_trip_bit_exact(start_daemon, layout, page_size, staging, alloc):
    d = start_daemon(**KNOBS, gpu_dma_stage_below="64KiB" if staging == "staged" else 0)
    chunks, ppc = 4, CHUNK // page_size
    pages = 2 * chunks * ppc + 3
    whole, views = one_allocation(layout, pages, page_size, block_outer=alloc == "block-outer")
    perm = torch.randperm(pages).tolist()
    src, dst = perm[:chunks * ppc], perm[chunks * ppc:2 * chunks * ppc]
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(CudaKVPool(layout, views, page_size=page_size), model=f"one-{layout}")
        tokens = np.random.default_rng().integers(0, 50000, chunks * CHUNK)
        expect = [[x.clone() for x in page_of(layout, views, p)] for p in src]
        torch.cuda.synchronize()
        assert client.store(tokens, src) == chunks * CHUNK
        for p in dst:
            for x in page_of(layout, views, p):
                x.view(torch.uint8).fill_(0xA5)
        before = whole.clone()
        time.sleep(2 * STAGE_IDLE_S)  # right after a store, a load goes straight
        assert client.load(tokens, dst) == chunks * CHUNK
        torch.cuda.synchronize()
        for p, want in zip(dst, expect):
            got = page_of(layout, views, p)
            assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8))
                       for g, w in zip(got, want)), f"page {p}"
            for x in got:
                x.view(torch.uint8).fill_(0xA5)
        assert torch.equal(whole.view(torch.uint8), before.view(torch.uint8))
    heads, dim = SHAPES[layout]
    small = page_size * heads * dim * 2 < 64 << 10
    how = "staged DMA" if staging == "staged" and small else "DMA"
    assert path_taken(d.log(), chunks) == [("gather", how), ("scatter", how)], d.log()
    assert d.stop() == 0, d.log()


def _dying_engine(runtime_dir: str, conn) -> None:
    import torch as t

    import kvd_client as kc
    from kvd_client.torch_pool import CudaKVPool as Pool
    whole = t.randn(LAYERS, 2, 1024, 16, 8, 128, dtype=t.bfloat16, device="cuda")
    client = kc.KvdClient(runtime_dir=runtime_dir, raise_errors=True, timeout=60).connect()
    client.register_kv(Pool("vllm_flash_attn", list(whole.unbind(0))), model="dying")
    tokens = np.arange(128 * CHUNK)  # 128 chunks of 4 pages, 5 MiB each: 640 MiB a direction
    t.cuda.synchronize()
    assert client.store(tokens, range(512)) == 128 * CHUNK
    time.sleep(0.1)  # staged once the other direction has been idle (STAGE_IDLE_S)
    client.submit_load(tokens, range(512, 1024))
    conn.send(os.getpid())
    time.sleep(120)


def test_engine_killed_mid_staged_load_is_reaped_after_it(start_daemon):
    d = start_daemon(**{**KNOBS, "gpu_copy_path": "auto", "gpu_stage_slot_bytes": "32MiB",
                        "gpu_dma_stage_below": "64KiB"},
                     client_timeout_s=1.0, heartbeat_interval_s=0.2)
    with engine_killed_after(_dying_engine, str(d.runtime_dir), timeout=120):
        time.sleep(0.002)  # the load is on the copy engines (about 13 ms of PCIe)
    wait_reaped(d, 20)
    whole, views = one_allocation("vllm_flash_attn", 40, 16)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(CudaKVPool("vllm_flash_attn", views), model="survivor")
        want = whole[:, :, :16].clone()
        torch.cuda.synchronize()
        assert client.store(np.arange(4 * CHUNK) + 9, range(16)) == 4 * CHUNK
        assert client.load(np.arange(4 * CHUNK) + 9, range(16, 32)) == 4 * CHUNK
        torch.cuda.synchronize()
        assert torch.equal(whole[:, :, 16:32].view(torch.uint8), want.view(torch.uint8))
    assert "scatter of 128 chunks, 671.1 MB, staged DMA" in d.log(), d.log()
    assert "CUDA error" not in d.log(), d.log()
    assert d.stop() == 0, d.log()


def per_layer_mla(pages: int, layers: int = LAYERS) -> list:
    """SGLang-style: each layer its own allocation; MLA pages of 64 tokens (72 KiB rows)."""
    return [torch.randint(0, 256, (pages, 64, 1152), dtype=torch.uint8,
                          device="cuda").view(torch.bfloat16) for _ in range(layers)]


THREADS = {"loop": ("false", "false"), "store thread": ("true", "false"),
           "both threads": ("true", "true")}


@pytest.mark.parametrize("threads", sorted(THREADS))
def test_per_layer_pool_of_72_kib_pages_round_trips_bit_exact(start_daemon, threads):
    """16 chunks of one page in 20 layers, each layer its own allocation: 320 rows of 72
    KiB a copy, on one stream (``gpu_dma_spread_below``), queued by the loop or by the
    threads; poisoned targets end equal to the sources, no other page moves."""
    store_thread, load_thread = THREADS[threads]
    d = start_daemon(**{**KNOBS, "gpu_copy_path": "auto"}, gpu_dma_store_thread=store_thread,
                     gpu_dma_load_thread=load_thread)
    layers = per_layer_mla(40)
    src, dst = list(range(0, 32, 2)), list(range(1, 33, 2))
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(CudaKVPool("vllm_mla", layers, page_size=64), model="per-layer")
        tokens = np.random.default_rng().integers(0, 50000, 16 * CHUNK)
        want = [x[src].clone() for x in layers]
        torch.cuda.synchronize()
        assert client.store(tokens, src) == 16 * CHUNK
        for x in layers:
            x.view(torch.uint8)[dst] = 0xA5
        before = [x.clone() for x in layers]
        assert client.load(tokens, dst) == 16 * CHUNK
        torch.cuda.synchronize()
        for x, w, b in zip(layers, want, before):
            assert torch.equal(x[dst].view(torch.uint8), w.view(torch.uint8))
            x[dst] = b[dst]
            assert torch.equal(x.view(torch.uint8), b.view(torch.uint8))
    assert path_taken(d.log(), 16) == [("gather", "DMA"), ("scatter", "DMA")], d.log()
    assert d.stop() == 0, d.log()


def _storing_engine(runtime_dir: str, loads: bool, conn) -> None:
    import torch as t

    import kvd_client as kc
    from kvd_client.torch_pool import CudaKVPool as Pool
    layers = [t.randn(1024, 64, 576, dtype=t.bfloat16, device="cuda") for _ in range(LAYERS)]
    client = kc.KvdClient(runtime_dir=runtime_dir, raise_errors=True, timeout=60).connect()
    client.register_kv(Pool("vllm_mla", layers, page_size=64), model="dying")
    t.cuda.synchronize()
    if loads:  # one store, then 4 loads of it (188 MB each: the window holds one)
        assert client.store(np.arange(128 * CHUNK), range(128)) == 128 * CHUNK
        for k in range(1, 5):
            client.submit_load(np.arange(128 * CHUNK), range(128 * k, 128 * k + 128))
    else:
        for k in range(4):  # 4 stores of 128 chunks, 2,560 rows each
            client.submit_store(np.arange(128 * CHUNK) + k * 10**6, range(128 * k, 128 * k + 128))
    conn.send(os.getpid())
    time.sleep(120)


KILLED = {"stores, loop": ("false", "false", False), "stores, store thread": ("true", "false", False),
          "loads, loop": ("true", "false", True), "loads, load thread": ("true", "true", True)}


@pytest.mark.parametrize("case", sorted(KILLED))
def test_engine_killed_with_its_per_layer_copies_queued_is_reaped_after_them(start_daemon, case):
    store_thread, load_thread, loads = KILLED[case]
    d = start_daemon(**{**KNOBS, "gpu_copy_path": "auto", "log_level": "info"},
                     client_timeout_s=1.0, heartbeat_interval_s=0.2,
                     gpu_dma_store_thread=store_thread, gpu_dma_load_thread=load_thread)
    with engine_killed_after(_storing_engine, str(d.runtime_dir), loads, timeout=120):
        pass  # at once: the stores are being planned and queued
    wait_reaped(d, 20)
    layers = per_layer_mla(40)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(CudaKVPool("vllm_mla", layers, page_size=64), model="survivor")
        want = [x[:16].clone() for x in layers]
        torch.cuda.synchronize()
        assert client.store(np.arange(16 * CHUNK) + 7, range(16)) == 16 * CHUNK
        assert client.load(np.arange(16 * CHUNK) + 7, range(16, 32)) == 16 * CHUNK
        torch.cuda.synchronize()
        assert all(torch.equal(x[16:32].view(torch.uint8), w.view(torch.uint8))
                   for x, w in zip(layers, want))
    assert "CUDA error" not in d.log() and "Traceback" not in d.log(), d.log()
    assert d.stop() == 0, d.log()
