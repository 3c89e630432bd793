"""Client processes for the warm restart tests (module-level: the spawn context imports them).

``writer`` stores prompt after prompt and reports each store as it starts
and when it returned, so the test knows which stores were acknowledged
when it killed the daemon. Prompt ``i`` is ``CHUNKS`` chunks of distinct
tokens whose KV is pages ``pages_of(i)`` of a pool filled from ``SEED``:
any process makes the same pool (``make_pool``) and knows each prompt's
bytes.
"""

from __future__ import annotations

import time

import numpy as np

import kvd_client

CHUNK = 16                 # tokens per chunk = the daemon's chunk_tokens = one page
CHUNKS = 16                # chunks per prompt (one store of 2 MiB)
PAGES = 128                # pages 0..63 hold prompts' KV, 64..127 are where loads land
GEOMETRY = dict(num_layers=4, num_pages=PAGES, page_size=CHUNK, kv_heads=8, head_dim=64,
                dtype="float16")  # 128 KiB per chunk
CHUNK_BYTES = 4 * 2 * CHUNK * 8 * 64 * 2
SEED = 2024
MODEL = "warm"


def make_pool() -> kvd_client.SharedKVPool:
    pool = kvd_client.SharedKVPool("vllm_flash_attn", **GEOMETRY)
    pool.raw[:] = np.random.default_rng(SEED).integers(0, 256, pool.raw.size, dtype=np.uint8)
    return pool


def tokens_of(i: int) -> np.ndarray:
    return np.arange(CHUNKS * CHUNK, dtype=np.int64) + i * 1_000_003


def pages_of(i: int) -> np.ndarray:
    """Prompt ``i``'s pages: a window of the first half of the pool that moves with ``i``."""
    return (np.arange(CHUNKS) + 7 * i) % (PAGES // 2)


def writer(runtime_dir: str, first: int, most: int, report, pause: float = 0.0) -> None:
    """Store prompts ``first``, ``first + 1``, ... (at most ``most``), sending ("start", i)
    before each store and ("done", i, tokens) after it, until a store fails; ``pause``
    seconds between stores."""
    client = kvd_client.KvdClient(runtime_dir=runtime_dir, timeout=2.0, raise_errors=False)
    pool = make_pool()
    try:
        client.connect()
        client.register_kv(pool, model=MODEL)
        report.send(("ready",))
        for i in range(first, first + most):
            report.send(("start", i))
            n = client.store(tokens_of(i), pages_of(i))
            report.send(("done", i, n))
            if n != CHUNKS * CHUNK:
                break
            time.sleep(pause)
    finally:
        report.send(("exit",))
        client.close()
        pool.close()
