"""Client processes for the failure tests (module-level: the spawn context imports them).

``victim`` registers a pool, leases some chunks and then stores large
requests in a loop until the test SIGKILLs it. ``holder`` registers a pool
and waits to be killed. ``roundtrip`` is a well-behaved engine: store,
lookup, load, compare raw bytes, close. ``random_pool`` and ``same_pages``
are the pools and byte checks of the tests themselves (test_failures*.py).
"""

from __future__ import annotations

import os
import time

import numpy as np

import kvd_client

# Geometry of the victim's pool: rows of 1 KiB, one page per 16-token chunk,
# 128 KiB per chunk; one store of every page moves 24 MiB.
VICTIM_GEOMETRY = dict(num_layers=4, page_size=16, kv_heads=8, head_dim=64, dtype="float16")
VICTIM_PAGES = 192
VICTIM_MODEL = "victim"
LEASED_TOKENS = np.arange(4 * 16, dtype=np.int64)  # 4 chunks, leased by the victim

GEOMETRY = ("vllm_flash_attn", 2, 64, 4, 2, 8, "float16")  # 2 KiB per 16-token chunk


def random_pool(seed: int, *geometry) -> kvd_client.SharedKVPool:
    pool = kvd_client.SharedKVPool(*(geometry or GEOMETRY))
    pool.raw[:] = np.random.default_rng(seed).integers(0, 256, pool.raw.size, dtype=np.uint8)
    return pool


def same_pages(pool, src: slice, dst: slice) -> bool:
    """Raw bytes of pages ``dst`` equal those of ``src`` in every tensor (NaN-safe)."""
    return all(bool((t.view(np.uint8)[:, dst] == t.view(np.uint8)[:, src]).all()) for t in pool.tensors)


def victim(runtime_dir: str, report, stores_started) -> None:
    """Lease 4 chunks, report, then store 24 MiB requests until killed."""
    client = kvd_client.KvdClient(runtime_dir=runtime_dir, raise_errors=True).connect()
    pool = kvd_client.SharedKVPool("vllm_flash_attn", num_pages=VICTIM_PAGES, **VICTIM_GEOMETRY)
    pool.raw[:] = np.random.default_rng(7).integers(0, 256, pool.raw.size, dtype=np.uint8)
    reg = client.register_kv(pool, model=VICTIM_MODEL)
    pages = np.arange(VICTIM_PAGES)
    assert client.store(LEASED_TOKENS, pages) == len(LEASED_TOKENS)
    hits, lease = client.lookup_lease(LEASED_TOKENS, 60_000)
    report.send({"pid": os.getpid(), "hits": hits, "lease": lease, "reg": reg.id,
                 "pool": str(pool.path)})
    report.close()
    rng = np.random.default_rng(os.getpid())
    while True:
        tokens = rng.integers(0, 2**31, VICTIM_PAGES * 16)
        with stores_started.get_lock():
            stores_started.value += 1
        client.store(tokens, pages)


def holder(runtime_dir: str, report) -> None:
    """Register a small pool (its file and its flag page in /dev/shm), report, wait."""
    client = kvd_client.KvdClient(runtime_dir=runtime_dir, raise_errors=True).connect()
    pool = kvd_client.SharedKVPool("vllm_flash_attn", 2, 16, 4, 2, 8, "float16")
    client.register_kv(pool, model="holder")
    report.send({"pid": os.getpid(), "pool": str(pool.path)})
    report.close()
    while True:
        time.sleep(1)


def roundtrip(runtime_dir: str, seed: int, model: str = "roundtrip") -> bool:
    """Store 4 chunks, look them up, load them elsewhere; True when bit-exact."""
    with kvd_client.KvdClient(runtime_dir=runtime_dir, raise_errors=True) as client:
        pool = kvd_client.SharedKVPool("vllm_flash_attn", 2, 64, 4, 2, 8, "float16")
        try:
            pool.raw[:] = np.random.default_rng(seed).integers(0, 256, pool.raw.size, dtype=np.uint8)
            client.register_kv(pool, model=model)
            tokens = np.arange(64) + seed * 1000
            assert client.store(tokens, np.arange(16)) == 64
            assert client.lookup(tokens) == 64
            assert client.load(tokens, np.arange(16, 32)) == 64
            return all(bool((t.view(np.uint8)[:, 16:32] == t.view(np.uint8)[:, 0:16]).all())
                       for t in pool.tensors)
        finally:
            pool.close()
