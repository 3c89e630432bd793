"""The CUDA data path end to end: daemon and engines in separate processes.

The pytest process is an engine (torch tensors exported through CUDA IPC);
``kvd serve --gpu on`` runs in a subprocess; a second engine runs in a
spawned process. vLLM's GPU blocks (``vllm_kv_blocks``: heads outer, or
``vllm_kv_blocks_nhc``: tokens outer; as token rows and kept whole, by DMA)
are also registered through the vLLM
connector's own pool code. Skipped without torch, cupy or a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
from gpu_env import require_gpu  # noqa: E402

torch = require_gpu()

import kvd_client  # noqa: E402
from kvd_client.torch_pool import CudaKVPool  # noqa: E402
from kvd_client.vllm import geometry as G  # noqa: E402
from kvd_client.vllm.pool import cuda_pool  # noqa: E402

pytestmark = pytest.mark.gpu
CHUNK = 64
GPU_KNOBS = {"chunk_tokens": CHUNK, "host_capacity": "512MiB", "gpu": "on"}
DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}


def make_tensors(layout: str, layers: int, pages: int, page_size: int, heads: int, dim: int, dtype):
    item = torch.tensor([], dtype=dtype).element_size()

    def rnd(*shape):
        raw = (*shape[:-1], shape[-1] * item)
        return torch.randint(0, 256, raw, dtype=torch.uint8, device="cuda").view(dtype)

    if layout == "vllm_flash_attn":
        return [rnd(2, pages, page_size, heads, dim) for _ in range(layers)]
    if layout == "vllm_flashinfer":
        return [rnd(pages, 2, page_size, heads, dim) for _ in range(layers)]
    if layout == "vllm_mla":
        return [rnd(pages, page_size, dim) for _ in range(layers)]
    if layout == "sglang_mha":
        return [(rnd(pages * page_size, heads, dim), rnd(pages * page_size, heads, dim)) for _ in range(layers)]
    if layout == "sglang_mla":
        return [rnd(pages * page_size, 1, dim) for _ in range(layers)]
    if layout == "vllm_kv_blocks":       # logical [blocks, heads, block_size, 2 * head_size]
        return [rnd(pages, heads, page_size, 2 * dim) for _ in range(layers)]
    if layout == "vllm_kv_blocks_nhc":   # the same, stored tokens outer
        return [rnd(pages, page_size, heads, 2 * dim).transpose(1, 2) for _ in range(layers)]
    assert layout == "page_first"
    return rnd(pages, layers, 2, page_size, heads, dim)


def page_rows(layout: str, tensors, page: int, page_size: int) -> torch.Tensor:
    """All bytes of one page across layers and planes, independent of kvd's code."""
    def u8(t):
        return t.contiguous().view(torch.uint8).flatten()
    tok = slice(page * page_size, (page + 1) * page_size)
    if layout == "vllm_flash_attn":
        return torch.cat([u8(t[:, page]) for t in tensors])
    if layout in ("vllm_flashinfer", "vllm_mla"):
        return torch.cat([u8(t[page]) for t in tensors])
    if layout.startswith("vllm_kv_blocks"):
        return torch.cat([u8(_physical(layout, t)[page]) for t in tensors])
    if layout == "sglang_mha":
        return torch.cat([u8(x[tok]) for k, v in tensors for x in (k, v)])
    if layout == "sglang_mla":
        return torch.cat([u8(t[tok]) for t in tensors])
    return u8(tensors[page])


def all_bytes(layout: str, tensors) -> torch.Tensor:
    flat = [tensors] if layout == "page_first" else (
        [x for pair in tensors for x in pair] if layout == "sglang_mha" else tensors)
    return torch.cat([t.contiguous().view(torch.uint8).flatten() for t in flat])


def _physical(layout: str, t: torch.Tensor) -> torch.Tensor:
    """A vLLM block tensor in its stored (contiguous) dim order."""
    return t.transpose(1, 2) if layout == "vllm_kv_blocks_nhc" else t


def token_rows(layout: str, tensors, pages: list) -> torch.Tensor:
    """[token, layer, plane, heads, head_dim] of the tokens kept in ``pages``, by the engines'
    own indexing (vLLM blocks: K and V are each head's halves; flash-attn: [2, B, N, H, D])."""
    rows = []
    for t in tensors:
        if layout == "vllm_flash_attn":
            x = t[:, pages].permute(1, 2, 0, 3, 4)                  # [P, N, 2, H, D]
        else:
            b, h, n, c = t[pages].shape
            x = t[pages].contiguous().view(b, h, n, 2, c // 2).permute(0, 2, 3, 1, 4)
        rows.append(x.reshape(-1, *x.shape[2:]))
    return torch.stack(rows, dim=1)


@pytest.fixture
def gpu_daemon(start_daemon):
    d = start_daemon(**GPU_KNOBS)
    yield d
    assert d.stop() == 0, d.log()


CASES = [(layout, ps, dt) for layout in ("vllm_flash_attn", "vllm_flashinfer", "vllm_mla",
                                          "vllm_kv_blocks", "vllm_kv_blocks_nhc",
                                          "sglang_mha", "sglang_mla", "page_first")
         for ps in (1, 16, 64) for dt in DTYPES]


COPY_PATHS = ("kernels", "dma")  # gpu_copy_path: SM kernels, or the copy engines alone


@pytest.fixture(params=COPY_PATHS)
def path_daemon(start_daemon, request):
    d = start_daemon(**GPU_KNOBS, gpu_copy_path=request.param)
    yield d
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("layout,page_size,dtype", CASES)
def test_store_then_load_other_pages_bit_exact(path_daemon, layout, page_size, dtype):
    gpu_daemon = path_daemon
    mla = layout.endswith("mla")
    heads, dim = (1, 576) if mla else (4, 64)
    ppc = CHUNK // page_size
    pages = 4 * ppc + 3
    tensors = make_tensors(layout, 3, pages, page_size, heads, dim, DTYPES[dtype])
    pool = CudaKVPool(layout.removesuffix("_nhc"), tensors, page_size=page_size)
    with kvd_client.KvdClient(runtime_dir=str(gpu_daemon.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model=f"m-{layout}")
        tokens = np.random.default_rng().integers(0, 50000, 2 * CHUNK)
        perm = torch.randperm(pages).tolist()
        src, dst = perm[:2 * ppc], perm[2 * ppc:4 * ppc]
        expect = [page_rows(layout, tensors, p, page_size).clone() for p in src]
        torch.cuda.synchronize()
        assert client.store(tokens, src) == 2 * CHUNK
        for p in dst:  # poison the target pages after the store
            _fill_page(layout, tensors, p, page_size, 0xA5)
        before = all_bytes(layout, tensors).clone()
        assert client.load(tokens, dst) == 2 * CHUNK
        torch.cuda.synchronize()
        for p, want in zip(dst, expect):
            assert torch.equal(page_rows(layout, tensors, p, page_size), want), f"page {p}"
        for p in dst:  # make the loaded pages equal their poison again, then nothing else moved
            _fill_page(layout, tensors, p, page_size, 0xA5)
        assert torch.equal(all_bytes(layout, tensors), before)


def _fill_page(layout, tensors, page, page_size, value):
    tok = slice(page * page_size, (page + 1) * page_size)
    if layout == "vllm_flash_attn":
        for t in tensors:
            t[:, page].view(torch.uint8).fill_(value)
    elif layout in ("vllm_flashinfer", "vllm_mla"):
        for t in tensors:
            t[page].view(torch.uint8).fill_(value)
    elif layout.startswith("vllm_kv_blocks"):
        for t in tensors:
            _physical(layout, t)[page].view(torch.uint8).fill_(value)
    elif layout == "sglang_mha":
        for k, v in tensors:
            k[tok].view(torch.uint8).fill_(value)
            v[tok].view(torch.uint8).fill_(value)
    elif layout == "sglang_mla":
        for t in tensors:
            t[tok].view(torch.uint8).fill_(value)
    else:
        tensors[page].view(torch.uint8).fill_(value)


@pytest.mark.parametrize("src, dst", [("vllm_kv_blocks", "vllm_kv_blocks_nhc"),
                                      ("vllm_kv_blocks_nhc", "vllm_flash_attn"),
                                      ("vllm_flash_attn", "vllm_kv_blocks")])
@pytest.mark.parametrize("page_size", [16, 1])
def test_vllm_gpu_blocks_share_chunks_through_the_connectors_pool(gpu_daemon, src, dst,
                                                                  page_size):
    """vLLM's blocks registered as the connector's worker registers them (attention mha, the
    plain model id) and a flash-attn pool of the same model: one's store is the other's
    hit, every token row exact, nothing but the target pages written."""
    heads, dim, layers = 4, 64, 3
    ppc = CHUNK // page_size
    pages = 4 * ppc + 3
    geo = G.KVGeometry(model="m-shared", kv_dtype="bfloat16", attention="mha", num_layers=layers,
                       kv_heads=heads, head_dim=dim, tp_size=1, block_size=page_size)

    def pool(layout, tensors):
        if layout == "vllm_flash_attn":
            return CudaKVPool(layout, tensors)
        return cuda_pool(geo, tensors, pages)

    a_t = make_tensors(src, layers, pages, page_size, heads, dim, torch.bfloat16)
    b_t = make_tensors(dst, layers, pages, page_size, heads, dim, torch.bfloat16)
    with kvd_client.KvdClient(runtime_dir=str(gpu_daemon.runtime_dir), raise_errors=True) as client:
        a = client.register_kv(pool(src, a_t), model="m-shared")
        b = client.register_kv(pool(dst, b_t), model="m-shared")
        assert a.namespace == b.namespace
        tokens = np.random.default_rng().integers(0, 50000, 2 * CHUNK)
        perm = torch.randperm(pages).tolist()
        src_pages, dst_pages = perm[:2 * ppc], perm[2 * ppc:4 * ppc]
        want = token_rows(src, a_t, src_pages).clone()
        torch.cuda.synchronize()
        assert client.store(tokens, src_pages, reg=a) == 2 * CHUNK
        for p in dst_pages:
            _fill_page(dst, b_t, p, page_size, 0xA5)
        before = all_bytes(dst, b_t).clone()
        assert client.load(tokens, dst_pages, reg=b) == 2 * CHUNK
        torch.cuda.synchronize()
        got = token_rows(dst, b_t, dst_pages)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        for p in dst_pages:
            _fill_page(dst, b_t, p, page_size, 0xA5)
        assert torch.equal(all_bytes(dst, b_t), before)


@pytest.mark.parametrize("layout", ["vllm_kv_blocks", "vllm_kv_blocks_nhc"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_whole_vllm_gpu_blocks_move_by_dma_bit_exact(gpu_daemon, layout, page_size):
    """vLLM's blocks kept whole (the connector's default gpu_block_format): the daemon's
    default copy path picks the copy engines for them (Llama-3-8B's 8 KV heads of 128: a
    block of 16 tokens is 64 KiB, gpu_dma_min_piece), and another engine of that block
    format loads every block byte for byte, nothing but its target blocks written."""
    heads, dim, layers = 8, 128, 3
    ppc = CHUNK // page_size
    pages = 4 * ppc + 3
    interior = "NHC" if layout.endswith("_nhc") else "HNC"
    geo = G.KVGeometry(model=f"m|vllm-gpu {interior} bs={page_size}", kv_dtype="bfloat16",
                       attention="opaque", num_layers=layers, kv_heads=heads, head_dim=2 * dim,
                       tp_size=1, block_size=page_size, interior=interior)
    a_t, b_t = (make_tensors(layout, layers, pages, page_size, heads, dim, torch.bfloat16)
                for _ in range(2))
    with kvd_client.KvdClient(runtime_dir=str(gpu_daemon.runtime_dir), raise_errors=True) as client:
        a = client.register_kv(cuda_pool(geo, a_t, pages), model=geo.model)
        b = client.register_kv(cuda_pool(geo, b_t, pages), model=geo.model)
        assert a.namespace == b.namespace
        tokens = np.random.default_rng().integers(0, 50000, 2 * CHUNK)
        perm = torch.randperm(pages).tolist()
        src, dst = perm[:2 * ppc], perm[2 * ppc:4 * ppc]
        want = [page_rows(layout, a_t, p, page_size).clone() for p in src]
        torch.cuda.synchronize()
        assert client.store(tokens, src, reg=a) == 2 * CHUNK
        for p in dst:
            _fill_page(layout, b_t, p, page_size, 0xA5)
        before = all_bytes(layout, b_t).clone()
        assert client.load(tokens, dst, reg=b) == 2 * CHUNK
        torch.cuda.synchronize()
        for p, w in zip(dst, want):
            assert torch.equal(page_rows(layout, b_t, p, page_size), w), f"block {p}"
        for p in dst:
            _fill_page(layout, b_t, p, page_size, 0xA5)
        assert torch.equal(all_bytes(layout, b_t), before)
    assert "copies by DMA" in gpu_daemon.log()


def test_store_waits_for_the_engine_stream(gpu_daemon):
    """Data written on the engine's stream after a long kernel is what gets stored."""
    tensors = make_tensors("vllm_flash_attn", 2, 8, 16, 4, 64, torch.bfloat16)
    pool = CudaKVPool("vllm_flash_attn", tensors)
    with kvd_client.KvdClient(runtime_dir=str(gpu_daemon.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model="ordering")
        tokens = np.arange(CHUNK)
        fresh = [torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, device="cuda")
                 for t in tensors]
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the new KV lands
        for t, f in zip(tensors, fresh):
            t.view(torch.uint8).copy_(f)
        assert client.store(tokens, range(4)) == CHUNK
        torch.cuda.synchronize()
        want = [page_rows("vllm_flash_attn", tensors, p, 16).clone() for p in range(4)]
        for t in tensors:
            t.view(torch.uint8).fill_(0)
        assert client.load(tokens, range(4, 8)) == CHUNK
        torch.cuda.synchronize()
        for i, p in enumerate(range(4, 8)):
            assert torch.equal(page_rows("vllm_flash_attn", tensors, p, 16), want[i])


def test_layerwise_load_on_the_engine_stream(path_daemon):
    gpu_daemon = path_daemon
    layers = 6
    tensors = make_tensors("vllm_flash_attn", layers, 16, 16, 8, 128, torch.bfloat16)
    pool = CudaKVPool("vllm_flash_attn", tensors)
    with kvd_client.KvdClient(runtime_dir=str(gpu_daemon.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model="layerwise")
        tokens = np.arange(2 * CHUNK)
        torch.cuda.synchronize()
        assert client.store(tokens, range(8)) == 2 * CHUNK
        want = [t[:, 0:8].clone() for t in tensors]
        for t in tensors:
            t[:, 8:16].view(torch.uint8).fill_(0x5A)
        torch.cuda.synchronize()
        transfer = client.submit_load(tokens, range(8, 16), layerwise=True)
        seen = []
        for layer in range(layers):
            client.wait_for_layer(layer, transfer)
            seen.append(tensors[layer][:, 8:16].clone())  # ordered after layer's flag word
        assert transfer.wait(60).ok and transfer.tokens == 2 * CHUNK, transfer
        torch.cuda.synchronize()
        for layer in range(layers):
            assert torch.equal(seen[layer].view(torch.uint8), want[layer].view(torch.uint8)), layer


def _second_engine(runtime_dir: str, tokens, expect: list, result_q) -> None:
    import torch as t

    import kvd_client as kc
    from kvd_client.torch_pool import CudaKVPool as Pool
    tensors = [t.zeros(2, 8, 16, 4, 64, dtype=t.bfloat16, device="cuda") for _ in range(2)]
    pool = Pool("vllm_flash_attn", tensors)
    with kc.KvdClient(runtime_dir=runtime_dir, raise_errors=True) as client:
        client.register_kv(pool, model="shared")
        hit = client.lookup(tokens)
        loaded = client.load(tokens, range(4, 8))
        t.cuda.synchronize()
        ok = all(t.equal(tensors[l][:, 4:8].cpu().view(t.uint8), expect[l]) for l in range(2))
    result_q.put((hit, loaded, ok))


def _dying_engine(runtime_dir: str, ready_q) -> None:
    import torch as t

    import kvd_client as kc
    from kvd_client.torch_pool import CudaKVPool as Pool
    tensors = [t.ones(2, 8, 16, 4, 64, dtype=t.bfloat16, device="cuda") for _ in range(2)]
    client = kc.KvdClient(runtime_dir=runtime_dir, raise_errors=True, heartbeat=False).connect()
    client.register_kv(Pool("vllm_flash_attn", tensors), model="dying")
    ready_q.put(os.getpid())
    time.sleep(60)


def test_two_engines_share_and_a_killed_engine_is_reaped(start_daemon):
    d = start_daemon(**GPU_KNOBS, client_timeout_s=1.0, heartbeat_interval_s=0.2)
    ctx = multiprocessing.get_context("spawn")
    tensors = make_tensors("vllm_flash_attn", 2, 8, 16, 4, 64, torch.bfloat16)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(CudaKVPool("vllm_flash_attn", tensors), model="shared")
        tokens = np.arange(CHUNK) + 7
        torch.cuda.synchronize()
        assert client.store(tokens, range(4)) == CHUNK
        expect = [t[:, 0:4].cpu().view(torch.uint8) for t in tensors]
        q = ctx.Queue()
        p = ctx.Process(target=_second_engine, args=(str(d.runtime_dir), tokens, expect, q))
        p.start()
        assert q.get(timeout=120) == (CHUNK, CHUNK, True)
        p.join(30)
        dying = ctx.Process(target=_dying_engine, args=(str(d.runtime_dir), q))
        dying.start()
        q.get(timeout=120)
        assert d.stats()["registrations"] == 2
        os.kill(dying.pid, signal.SIGKILL)
        dying.join(10)
        deadline = time.monotonic() + 15
        while d.stats()["clients_reaped"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        stats = d.stats()
        assert stats["clients_reaped"] >= 1 and stats["registrations"] == 1
        assert client.lookup(tokens) == CHUNK  # the survivor keeps working
        assert client.load(tokens, range(4, 8)) == CHUNK
    assert d.stop() == 0, d.log()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_daemon_serves_pools_on_two_gpus(gpu_daemon):
    """A chunk stored from GPU 0's pool loads bit-exact into GPU 1's pool."""
    pools, tensors = [], []
    for dev in (0, 1):
        with torch.cuda.device(dev):
            t = make_tensors("vllm_flash_attn", 2, 8, 16, 4, 64, torch.bfloat16)
            tensors.append(t)
            pools.append(CudaKVPool("vllm_flash_attn", t))
    with kvd_client.KvdClient(runtime_dir=str(gpu_daemon.runtime_dir), raise_errors=True) as client:
        regs = [client.register_kv(p, model="two-gpus") for p in pools]
        tokens = np.arange(CHUNK) + 99
        torch.cuda.synchronize(0)
        assert client.store(tokens, range(4), reg=regs[0]) == CHUNK
        for t in tensors[1]:
            t[:, 4:8].view(torch.uint8).fill_(0x3C)
        torch.cuda.synchronize(1)
        assert client.load(tokens, range(4, 8), reg=regs[1]) == CHUNK
        torch.cuda.synchronize(1)
        for src, dst in zip(tensors[0], tensors[1]):
            assert torch.equal(src[:, 0:4].cpu().view(torch.uint8), dst[:, 4:8].cpu().view(torch.uint8))


@pytest.mark.parametrize("path", COPY_PATHS)
def test_chunks_across_host_registration_pieces(start_daemon, path):
    """A host tier over 1 GiB is pinned in pieces; chunks straddling a piece
    boundary must store and load bit-exact (one DMA cannot cross pieces)."""
    d = start_daemon(**{**GPU_KNOBS, "host_capacity": "1200MiB", "gpu_copy_path": path})
    tensors = make_tensors("vllm_flash_attn", 3, 64, 16, 8, 128, torch.bfloat16)  # 768 KiB shards
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True, timeout=60) as client:
        client.register_kv(CudaKVPool("vllm_flash_attn", tensors), model="pieces")
        n = 8  # chunks per request: pages 0..31 are the source, 32..63 the target
        want = [t[:, 0:32].clone() for t in tensors]
        torch.cuda.synchronize()
        for r in range(180):  # 1440 chunks x 768 KiB > 1 GiB: some straddle the boundary
            tokens = np.arange(n * CHUNK) + r * 10**6
            assert client.store(tokens, range(32)) == n * CHUNK
            if r % 6 == 5 or r > 160:
                for t in tensors:
                    t[:, 32:64].view(torch.uint8).fill_(0x11)
                assert client.load(tokens, range(32, 64)) == n * CHUNK
                torch.cuda.synchronize()
                for t, w in zip(tensors, want):
                    assert torch.equal(t[:, 32:64].view(torch.uint8), w.view(torch.uint8)), r
    assert d.stop() == 0, d.log()
