"""SGLang's HiCache and vLLM engines share chunks through kvd, byte for byte.

The SGLang engines run in test_hicache.py's worker (its fixtures); the test
process is itself a kvd client with a vLLM flash-attn layout, vLLM's MLA
blocks, or vLLM 0.32's GPU blocks (heads or tokens outer, registered by the
vLLM connector's own worker code, tests/vllm_blocks.py), of the same model,
dtype and TP size: a chunk one engine stores is a hit, with exact bytes, for
the other. Skipped, as test_hicache.py is (its ``pytestmark``), without the
SGLang venv.
"""

from __future__ import annotations

import numpy as np
import pytest
# test_hicache's fixtures, and its pytestmark: skipped as it is
from test_hicache import daemon, engines, pages_bytes, pytestmark, sgl, tokens  # noqa: F401
from vllm_blocks import VllmBlocksPool, VllmMLAPool, over, put_rows, token_rows

from kvd_client import KvdClient, SharedKVPool
from kvd_client.vllm.counters import Counters
from kvd_client.vllm.worker import WorkerSide

LAYERS, HEADS, DIM = 3, 2, 8  # the SGLang worker's engines (sglang_worker.py's defaults)


def vllm_pool(num_pages=16):
    return SharedKVPool("vllm_flash_attn", num_layers=LAYERS, num_pages=num_pages, page_size=16,
                        kv_heads=HEADS, head_dim=DIM, dtype="bfloat16")


def sglang_pages_to_canonical(pages: list[bytes], page_size: int) -> np.ndarray:
    """SGLang pages (page order [L, 2, P, H, D]) as [chunks of 16, L, 2, 16, H, D] uint16."""
    arr = np.stack([np.frombuffer(p, dtype=np.uint16).reshape(LAYERS, 2, page_size, HEADS, DIM)
                    for p in pages])
    per = page_size // 16
    arr = arr.reshape(len(pages), LAYERS, 2, per, 16, HEADS, DIM).transpose(0, 3, 1, 2, 4, 5, 6)
    return arr.reshape(len(pages) * per, LAYERS, 2, 16, HEADS, DIM)


def vllm_blocks(pool, blocks: int) -> np.ndarray:
    """The vLLM pool's first ``blocks`` blocks as [block, L, 2, 16, H, D]."""
    return np.stack([pool.tensors[layer][:, :blocks] for layer in range(LAYERS)]).transpose(2, 0, 1, 3, 4, 5)


def test_cross_engine_sglang_store_is_a_vllm_hit(daemon, engines):
    """SGLang pages of 32 tokens (2 kvd chunks each); a vLLM flash-attn pool of 16-token blocks."""
    a = engines(daemon.runtime_dir, "a", page_size=32, layout="page_first")
    prompt = tokens(128)
    stored = a.fill_set(keys=a.hash(prompt), seed=4)
    assert stored["results"] == [True] * 4
    pool = vllm_pool()
    with KvdClient(str(daemon.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model="tiny")
        assert client.lookup(prompt) == 128
        assert client.load(prompt, list(range(8))) == 128
        assert np.array_equal(vllm_blocks(pool, 8),
                              sglang_pages_to_canonical(pages_bytes(stored["pages"]), 32))
        assert client.lookup(prompt, salt="request:t1") == 0  # another salt: other entries
    pool.close()


def test_cross_engine_vllm_store_is_an_sglang_hit(daemon, engines, sgl):
    a = engines(daemon.runtime_dir, "a", page_size=32, layout="layer_first")
    prompt = tokens(96)
    pool = vllm_pool()
    rng = np.random.default_rng(5)
    for t in pool.tensors:
        t[...] = rng.integers(0, 2**16, size=t.shape, dtype=np.uint16)
    with KvdClient(str(daemon.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model="tiny")
        assert client.store(prompt, list(range(6))) == 96
        salted = tokens(64)
        assert client.store(salted, list(range(4)), salt="request:t1") == 64
    keys = a.hash(prompt)
    assert a.exists(keys=keys) == 3
    got = a.get(keys=keys)
    assert got["results"] == [True] * 3
    assert np.array_equal(sglang_pages_to_canonical(pages_bytes(got["pages"]), 32), vllm_blocks(pool, 6))
    if sgl("info")["namespaced"]:  # SGLang's per-request cache_salt and vLLM's: one kvd salt
        assert a.exists(keys=a.hash(salted, cache_salt="t1")) == 2
    else:  # 0.5.16's hashes of a namespaced request are the plain ones: misses, never those
        assert a.exists(keys=a.hash(salted, extra_key="t1")) == 0
    assert a.exists(keys=a.hash(salted)) == 0
    pool.close()


def test_vllm_mla_blocks_and_sglang_mla_pages_are_one_entry(daemon, engines):
    """SGLang's MLA pages ([L, P, latent] in page order) and vLLM's MLA blocks hold the same
    latent rows: a store of either is the other's hit, row for row."""
    a = engines(daemon.runtime_dir, "a", page_size=32, layout="page_first", mla=True)
    prompt, back = tokens(128), tokens(64)
    stored = a.fill_set(keys=a.hash(prompt), seed=21)
    assert stored["results"] == [True] * 4

    def sglang_rows(pages: list[bytes]) -> np.ndarray:  # [token, layer, latent bytes]
        arr = np.stack([np.frombuffer(p, np.uint8).reshape(LAYERS, 32, DIM * 2) for p in pages])
        return np.ascontiguousarray(arr.transpose(0, 2, 1, 3).reshape(-1, LAYERS, DIM * 2))
    pool = VllmMLAPool(LAYERS, num_blocks=16, block_size=16, dim=DIM)
    try:
        with KvdClient(str(daemon.runtime_dir), raise_errors=True) as client:
            client.register_kv(pool, model="tiny")
            pool.raw[:] = 0xA5
            blocks = [3, 9, 0, 12, 5, 7, 1, 14]
            assert client.load(prompt, blocks) == 128
            assert np.array_equal(pool.rows(blocks), sglang_rows(pages_bytes(stored["pages"])))
            pool.raw[:] = np.random.default_rng(22).integers(0, 256, pool.raw.size, dtype=np.uint8)
            assert client.store(back, blocks[:4]) == 64
        got = a.get(keys=a.hash(back))
        assert got["results"] == [True] * 2
        assert np.array_equal(sglang_rows(pages_bytes(got["pages"])), pool.rows(blocks[:4]))
    finally:
        pool.close()


def sglang_token_rows(pages: list[bytes], page_size: int) -> np.ndarray:
    """SGLang pages as [token, layer, plane, heads, head_dim bytes] (``token_rows``'s form)."""
    per_chunk = sglang_pages_to_canonical(pages, page_size)         # [c, L, 2, 16, H, D]
    rows = per_chunk.transpose(0, 3, 1, 2, 4, 5).reshape(-1, LAYERS, 2, HEADS, DIM)
    return np.ascontiguousarray(rows).view(np.uint8)


def vllm_gpu_worker(client, order: str, block_size: int, blocks: int):
    """A vLLM 0.32 GPU worker's blocks (in /dev/shm), registered by the connector's worker
    code: attention mha, model "tiny" as SGLang's, TP 1."""
    pool = VllmBlocksPool(order, LAYERS, blocks, block_size, HEADS, DIM, dtype="bfloat16",
                          model="tiny")
    worker = WorkerSide(client, pool.geo, [f"model.layers.{i}" for i in range(LAYERS)], 0,
                        Counters())
    worker.register(pool)
    return pool, worker.reg


@pytest.mark.parametrize("order", ["HNC", "NHC"])
def test_cross_engine_vllm_gpu_blocks_store_is_an_sglang_hit(daemon, engines, order):
    a = engines(daemon.runtime_dir, "a", page_size=32, layout="page_first")
    prompt = tokens(96)
    with KvdClient(str(daemon.runtime_dir), raise_errors=True) as client:
        pool, reg = vllm_gpu_worker(client, order, 16, 16)
        pool.raw[:] = np.random.default_rng(11).integers(0, 256, pool.raw.size, dtype=np.uint8)
        blocks = [9, 2, 14, 0, 5, 7]
        assert client.store(prompt, blocks, reg=reg) == 96
    keys = a.hash(prompt)
    assert a.exists(keys=keys) == 3
    got = a.get(keys=keys)
    assert got["results"] == [True] * 3
    assert np.array_equal(sglang_token_rows(pages_bytes(got["pages"]), 32), token_rows(pool, blocks))
    pool.close()


@pytest.mark.parametrize("order", ["HNC", "NHC"])
def test_cross_engine_sglang_store_is_a_vllm_gpu_blocks_hit(daemon, engines, order):
    """SGLang pages of 32 tokens; vLLM blocks of 4 tokens, loaded into poisoned blocks: every
    row exact, no other byte of the vLLM pool changed."""
    a = engines(daemon.runtime_dir, "a", page_size=32, layout="layer_first")
    prompt = tokens(128)
    stored = a.fill_set(keys=a.hash(prompt), seed=12)
    assert stored["results"] == [True] * 4
    want = sglang_token_rows(pages_bytes(stored["pages"]), 32)
    with KvdClient(str(daemon.runtime_dir), raise_errors=True) as client:
        pool, reg = vllm_gpu_worker(client, order, 4, 40)
        pool.raw[:] = np.random.default_rng(13).integers(0, 256, pool.raw.size, dtype=np.uint8)
        before = pool.raw.copy()
        blocks = np.random.default_rng(14).permutation(40)[:32]
        assert client.lookup(prompt, reg=reg) == 128
        assert client.load(prompt, blocks, reg=reg) == 128
        assert client.lookup(prompt, reg=reg, salt="request:t1") == 0
    assert np.array_equal(token_rows(pool, blocks), want)
    put_rows(pool, over(pool, before), blocks, want)
    assert np.array_equal(pool.raw, before)
    pool.close()
