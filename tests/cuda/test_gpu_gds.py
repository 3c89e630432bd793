"""GPU Direct Storage loads (kvd/cuda/gds.py) and the GPU digest kernel.

Needs torch, cupy, a GPU and KvikIO (on the GPU machine: staged with
``bash ../shared/gpu/stage.sh kvikio-cu13 libkvikio-cu13 rapids-logger
cuda-pathfinder nvidia-cufile``: the wheel of libkvikio loads cuFile and the
RAPIDS logger through those, and ``import kvikio`` fails without them).
GDS runs there in KvikIO's compatibility mode, which is what these tests
need: the path, the verification and the fallbacks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

import kvd_client  # noqa: E402
from kvd.tiers.disk import chunk_file as F  # noqa: E402
from kvd.tiers.disk import digest as D  # noqa: E402
from kvd_client.torch_pool import CudaKVPool  # noqa: E402
from kvd_protocol.keys import namespace_digest  # noqa: E402

pytestmark = pytest.mark.gpu
CHUNK = 64
LAYERS, PAGES, PAGE, HEADS, DIM = 3, 200, 16, 4, 64
PPC = CHUNK // PAGE
SHARD = LAYERS * 2 * CHUNK * HEADS * DIM * 2  # 96 KiB


@pytest.mark.parametrize("length", [4096, 65536, 65536 + 4096, 3 * 65536 + 8192])
def test_digest_kernel_matches_the_cpu(length):
    from kvd.cuda.digest import SegmentHasher
    rng = np.random.default_rng(length)
    n, stride = 3, D.padded_length(length) + 8192
    host = rng.integers(0, 256, n * stride, dtype=np.uint8)
    dev = cupy.asarray(host)
    got = SegmentHasher(0).digests(int(dev.data.ptr), stride, length, n, cupy.cuda.Stream())
    for c in range(n):
        want = D.segment_digests(host[c * stride:c * stride + length])
        assert got[c].tolist() == want.tolist(), c


def _knobs(tmp_path: Path, **extra) -> dict:
    return {"chunk_tokens": CHUNK, "gpu": "on", "host_capacity": "64MiB",
            "disk_dir": str(tmp_path / "disk"), "disk_capacity": "1GiB", "disk_gds": "true",
            "disk_gds_slot_bytes": "1MiB", **extra}


def _pool():
    tensors = [torch.randint(0, 256, (2, PAGES, PAGE, HEADS, DIM * 2), dtype=torch.uint8,
                             device="cuda").view(torch.bfloat16) for _ in range(LAYERS)]
    return tensors, CudaKVPool("vllm_flash_attn", tensors)


def _to_disk_only(d) -> None:
    d.control("flush_disk")
    d.control("clear")
    host = d.stats()["tiers"]["host"]
    assert host["chunks"] == 0, host


@pytest.fixture
def gds_daemon(start_daemon, tmp_path):
    kvikio = pytest.importorskip("kvikio")  # noqa: F841 - the point is the skip
    d = start_daemon(**_knobs(tmp_path))
    yield d
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("layerwise", [False, True])
def test_disk_only_chunks_load_into_pages_bit_exact(gds_daemon, layerwise):
    tensors, pool = _pool()
    n = 24  # 24 x 96 KiB: 3 batches of the 1 MiB slots (10 chunks each)
    with kvd_client.KvdClient(runtime_dir=str(gds_daemon.runtime_dir), raise_errors=True) as c:
        c.register_kv(pool, model="gds")
        tokens = np.random.default_rng(1).integers(0, 50000, n * CHUNK)
        src = list(range(n * PPC))
        dst = list(range(2 * n * PPC - 1, n * PPC - 1, -1))  # other pages, in reverse
        want = [t[:, src].clone() for t in tensors]
        torch.cuda.synchronize()
        assert c.store(tokens, src) == n * CHUNK
        _to_disk_only(gds_daemon)
        assert c.lookup(tokens) == n * CHUNK
        for t in tensors:
            t.view(torch.uint8).fill_(0xA5)
        t = c.submit_load(tokens, dst, layerwise=layerwise)
        if layerwise:
            for layer in range(LAYERS):
                c.wait_for_layer(layer, t)
        assert t.wait(60).ok and t.tokens == n * CHUNK, t
        torch.cuda.synchronize()
        for t, w in zip(tensors, want):
            assert torch.equal(t[:, dst].view(torch.uint8), w.view(torch.uint8))
            rest = [p for p in range(PAGES) if p not in dst]
            assert bool((t[:, rest].view(torch.uint8) == 0xA5).all())
    st = gds_daemon.stats()
    disk = st["tiers"]["disk"]
    assert disk["gds"]["direct_chunks"] == n and disk["promotions"] == 0, disk
    assert st["tiers"]["host"]["chunks"] == 0  # the host tier was bypassed
    assert "GPU Direct Storage on GPU 0" in gds_daemon.log()


def test_corrupt_chunk_ends_the_prefix_and_is_never_loaded(gds_daemon, tmp_path):
    tensors, pool = _pool()
    with kvd_client.KvdClient(runtime_dir=str(gds_daemon.runtime_dir), raise_errors=True) as c:
        reg = c.register_kv(pool, model="gds-bad")
        tokens = np.arange(4 * CHUNK)
        torch.cuda.synchronize()
        assert c.store(tokens, range(4 * PPC)) == 4 * CHUNK
        want = [t[:, :PPC].clone() for t in tensors]
        _to_disk_only(gds_daemon)
        keys = c.keys(tokens, reg=reg)  # the second chunk's file gets one flipped byte
        path = F.chunk_path(tmp_path / "disk", namespace_digest(reg.namespace), keys[1])
        raw = bytearray(path.read_bytes())
        raw[F.HEADER_BYTES + 12345] ^= 0x40
        path.write_bytes(bytes(raw))
        dst = list(range(4 * PPC, 8 * PPC))
        for t in tensors:
            t[:, 4 * PPC:8 * PPC].view(torch.uint8).fill_(0x3C)  # a slice: a view, not a copy
        torch.cuda.synchronize()
        assert c.load(tokens, dst) == CHUNK
        torch.cuda.synchronize()
        for t, w in zip(tensors, want):
            assert torch.equal(t[:, dst[:PPC]].view(torch.uint8), w.view(torch.uint8))
            assert bool((t[:, dst[PPC:]].view(torch.uint8) == 0x3C).all())
    disk = gds_daemon.stats()["tiers"]["disk"]
    assert disk["checksum_failures"] == 1 and not path.exists()


def test_tp_sharded_chunks_take_the_host_path(gds_daemon):
    tensors, pool = _pool()
    with kvd_client.KvdClient(runtime_dir=str(gds_daemon.runtime_dir), raise_errors=True) as c:
        reg0 = c.register_kv(pool, model="gds-tp", tp_size=2, tp_rank=0)
        tokens = np.arange(2 * CHUNK) + 7
        want = [t[:, :2 * PPC].clone() for t in tensors]
        torch.cuda.synchronize()
        assert c.store(tokens, range(2 * PPC), reg=reg0) == 2 * CHUNK
        _tensors1, pool1 = _pool()  # an entry is complete once rank 1 stored its shard too
        reg1 = c.register_kv(pool1, model="gds-tp", tp_size=2, tp_rank=1)
        torch.cuda.synchronize()
        assert c.store(tokens, range(2 * PPC), reg=reg1) == 2 * CHUNK
        _to_disk_only(gds_daemon)
        dst = list(range(2 * PPC, 4 * PPC))
        assert c.load(tokens, dst, reg=reg0) == 2 * CHUNK
        torch.cuda.synchronize()
        for t, w in zip(tensors, want):
            assert torch.equal(t[:, dst].view(torch.uint8), w.view(torch.uint8))
    disk = gds_daemon.stats()["tiers"]["disk"]
    assert disk["promotions"] == 2 and disk["gds"]["direct_chunks"] == 0, disk


def test_gds_io_error_falls_back_to_the_host_path(start_daemon, tmp_path):
    pytest.importorskip("kvikio")
    d = start_daemon(faults="gds_eio", **_knobs(tmp_path))  # every GDS read fails; host reads work
    tensors, pool = _pool()
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as c:
        c.register_kv(pool, model="gds-eio")
        tokens = np.arange(3 * CHUNK) + 11
        want = [t[:, :3 * PPC].clone() for t in tensors]
        torch.cuda.synchronize()
        assert c.store(tokens, range(3 * PPC)) == 3 * CHUNK
        _to_disk_only(d)
        dst = list(range(3 * PPC, 6 * PPC))
        t = c.submit_load(tokens, dst, layerwise=True)
        for layer in range(LAYERS):
            c.wait_for_layer(layer, t)
        assert t.wait(60).ok and t.tokens == 3 * CHUNK, t
        torch.cuda.synchronize()
        for t, w in zip(tensors, want):
            assert torch.equal(t[:, dst].view(torch.uint8), w.view(torch.uint8))
    disk = d.stats()["tiers"]["disk"]
    assert disk["gds"]["fallbacks"] == 1 and disk["gds"]["direct_chunks"] == 0, disk
    assert disk["promotions"] == 3 and disk["read_errors"] >= 1 and disk["checksum_failures"] == 0
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("layerwise", [False, True])
def test_host_prefix_by_dma_and_gds_rest_both_land_before_the_words(start_daemon, tmp_path,
                                                                   layerwise):
    """A pool copied by DMA (``gpu_copy_path = dma``): the first chunks come from the host
    tier on the copy engines, the rest by GPU Direct Storage through kernels on another
    stream. Every layer word and the done word follow both (``CopyPlan.after_device``):
    each layer's pages, read on the engine's stream right after its wait, hold the stored
    bytes."""
    pytest.importorskip("kvikio")
    d = start_daemon(**_knobs(tmp_path, gpu_copy_path="dma"))
    tensors, pool = _pool()
    n, host = 24, 2
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as c:
        c.register_kv(pool, model="gds-dma")
        tokens = np.random.default_rng(3).integers(0, 50000, n * CHUNK)
        src, dst = list(range(n * PPC)), list(range(2 * n * PPC - 1, n * PPC - 1, -1))
        want = [t[:, src].clone() for t in tensors]
        torch.cuda.synchronize()
        assert c.store(tokens, src) == n * CHUNK
        _to_disk_only(d)
        assert c.store(tokens[:host * CHUNK], src[:host * PPC]) == host * CHUNK  # back in host
        for t in tensors:
            t.view(torch.uint8).fill_(0xA5)
        torch.cuda.synchronize()
        t = c.submit_load(tokens, dst, layerwise=layerwise)
        got = []
        for layer in range(LAYERS) if layerwise else ():
            c.wait_for_layer(layer, t)
            got.append(tensors[layer][:, dst].clone())  # queued behind the wait
        assert t.wait(60).ok and t.tokens == n * CHUNK, t
        torch.cuda.synchronize()
        for layer, (x, w) in enumerate(zip(tensors, want)):
            assert torch.equal(x[:, dst].view(torch.uint8), w.view(torch.uint8)), layer
            if layerwise:
                assert torch.equal(got[layer].view(torch.uint8), w.view(torch.uint8)), layer
    st = d.stats()
    assert st["tiers"]["disk"]["gds"]["direct_chunks"] == n - host, st["tiers"]["disk"]
    assert "copies by DMA" in d.log(), d.log()  # the pool took the DMA path
    assert d.stop() == 0, d.log()
