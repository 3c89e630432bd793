"""Client-side halves of the bounded-resources tests, run in spawned processes.

``hot_writer`` keeps the copies busy with stores whose first half is one of
two hot prefixes (cached once, touched by every store) and whose second half
is new, through a full host tier: the hot chunks stay resident and unsealed
while everything else turns over. ``steady_engine`` stores, looks up and
loads in a loop and reports its per-round latencies; ``churner`` connects,
registers and leaves over and over; ``scrape_flood`` scrapes /metrics from
several threads back to back. Each runs for ``seconds`` and returns what it
did.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import Counter

import numpy as np

import kvd_client

CHUNK = 16  # the test daemons' chunk_tokens (one page)
GEOMETRY = dict(num_layers=1, num_pages=64, page_size=CHUNK, kv_heads=8, head_dim=32,
                dtype="float16")
CHUNK_BYTES = 2 * CHUNK * 8 * 32 * 2  # 16 KiB: a 64 MiB host tier holds 4096 chunks
PROMPT = 8  # chunks per store: 4 of a hot prefix, 4 new


def _client(runtime_dir: str, name: str):
    pool = kvd_client.SharedKVPool("vllm_flash_attn", **GEOMETRY)
    client = kvd_client.KvdClient(runtime_dir=runtime_dir, timeout=5.0, raise_errors=True)
    try:
        client.connect()
        client.register_kv(pool, model=name)
    except BaseException:
        client.close()
        pool.close()
        raise
    return client, pool


def prompt(i: int, seed: int, hot: bool) -> np.ndarray:
    """Prompt ``i``: new tokens, the first half one of two hot prefixes when ``hot``."""
    tokens = np.arange(PROMPT * CHUNK, dtype=np.int64) + (seed * 7919 + i) * 1009 % 2**31
    if hot:
        tokens[:PROMPT * CHUNK // 2] = np.arange(PROMPT * CHUNK // 2) + 3_000_000_000 + i % 2 * 997
    return tokens


def hot_writer(runtime_dir: str, seed: int, seconds: float) -> dict:
    client, pool = _client(runtime_dir, "hot")
    stores, deadline = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            client.store(prompt(stores, seed, hot=True), np.arange(PROMPT))
            stores += 1
        return {"stores": stores}
    finally:
        client.close()
        pool.close()


def steady_engine(runtime_dir: str, seed: int, seconds: float, stop=None) -> dict:
    """Store, look up and load a new prompt per round for ``seconds`` (or until ``stop``
    is set); the seconds each round took."""
    client, pool = _client(runtime_dir, f"steady-{seed}")
    rounds, deadline = [], time.monotonic() + seconds
    src, dst = np.arange(PROMPT), np.arange(PROMPT, 2 * PROMPT)
    try:
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            tokens = prompt(len(rounds), seed, hot=False)
            t0 = time.perf_counter()
            client.store(tokens, src)
            if client.lookup(tokens) == len(tokens):
                client.load(tokens, dst)
            rounds.append(time.perf_counter() - t0)
        return {"rounds": rounds}
    finally:
        client.close()
        pool.close()


def scrape_flood(port: int, seconds: float, threads: int = 8) -> dict:
    """``threads`` threads scraping /metrics back to back for ``seconds``: scrapes served
    and refused (closed before a reply)."""
    counts = Counter()
    deadline = time.monotonic() + seconds

    def scrape_loop() -> None:
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    r.read()
                counts["served"] += 1
            except OSError:
                counts["refused"] += 1

    pool = [threading.Thread(target=scrape_loop) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return dict(counts)


def churner(runtime_dir: str, seconds: float) -> dict:
    """Connect, register a pool, store once and leave, over and over."""
    sessions, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        client, pool = _client(runtime_dir, f"churn-{sessions}")
        try:
            client.store(prompt(sessions, 99, hot=False)[:CHUNK], np.arange(1))
        finally:
            client.close()
            pool.close()
        sessions += 1
    return {"sessions": sessions}
