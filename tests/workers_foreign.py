"""Client halves of tests/server/test_foreign_reads.py, run in spawned processes.

An owner stores chunks from random non-zero bytes and returns their keys; a
reader registers a zero-filled pool of its own (or attaches, with no pool)
under some namespace and geometry and sends keys it was given, as a client
that learnt another tenant's keys would. ``read`` reports what its lookup
and its load answered (in chunks) and which of its pages hold anything but
zeros afterwards, read through the engine's own tensor indexing.
"""

from __future__ import annotations

import numpy as np

import kvd_client
from kvd_client import ChunkKeys

CHUNK = 16
# layout, layers, pages, page size, kv heads (of a shard), head dim, dtype
GEOMETRY = ("vllm_flash_attn", 2, 64, 4, 2, 8, "float16")  # shards of 2 KiB
BIG = ("vllm_flash_attn", 2, 64, 4, 8, 64, "float16")  # shards of 64 KiB
PPC = CHUNK // GEOMETRY[3]


def tokens(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, chunks * CHUNK)


def _client(runtime_dir: str) -> kvd_client.KvdClient:
    return kvd_client.KvdClient(runtime_dir=runtime_dir, timeout=10, raise_errors=True).connect()


def store(runtime_dir: str, geometry: tuple, reg: dict, toks, seed: int) -> list:
    """Store ``toks`` from pages 0.. of a pool of random non-zero bytes; their keys."""
    pool = kvd_client.SharedKVPool(*geometry)
    try:
        pool.raw[:] = np.random.default_rng(seed).integers(1, 256, pool.raw.size, np.uint8)
        with _client(runtime_dir) as c:
            r = c.register_kv(pool, **reg)
            chunks = len(toks) // CHUNK
            assert c.store(toks, np.arange(chunks * PPC), reg=r) == chunks * CHUNK
            return c.keys(toks, reg=r)
    finally:
        pool.close()


def read(runtime_dir: str, geometry: tuple, reg: dict, keys: list) -> dict:
    """Lookup, then load ``keys`` into pages 0.. of a zero-filled pool registered as ``reg``."""
    pool = kvd_client.SharedKVPool(*geometry)
    try:
        with _client(runtime_dir) as c:
            r = c.register_kv(pool, **reg)
            hits = c.lookup(ChunkKeys(keys), reg=r)
            loaded = c.load(ChunkKeys(keys), np.arange(len(keys) * PPC), reg=r)
            return {"hits": hits // CHUNK, "loaded": loaded // CHUNK, "written": _written(pool)}
    finally:
        pool.close()


def attach_lookup(runtime_dir: str, geometry: tuple, reg: dict, keys: list) -> int:
    """Chunks a lookup of ``keys`` hits through an attached namespace (no pool)."""
    _, layers, _, _, heads, dim, dtype = geometry
    with _client(runtime_dir) as c:
        r = c.attach(kv_dtype=dtype, attention="mha", num_layers=layers, kv_heads=heads,
                     head_dim=dim, **reg)
        return c.lookup(ChunkKeys(keys), reg=r) // CHUNK


def _written(pool) -> list:
    """Page ids holding any non-zero byte (vllm_flash_attn: [K|V, page, token, head, dim])."""
    pages = set()
    for t in pool.tensors:
        raw = t.view(np.uint16)
        pages.update(int(p) for p in np.flatnonzero(raw.reshape(2, raw.shape[1], -1).any(axis=(0, 2))))
    return sorted(pages)
