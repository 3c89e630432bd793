"""Client-side halves of tests/tiers/test_disk_tier.py, run in spawned processes.

Built on tests/workers_data.py: pools filled from seeds, expected bytes
regenerated from the storer's seed and read by the engine's own tensor
indexing, never by kvd's copy code. Sequence ``i`` of a storer uses its own
slice of the storer's pages, so any sequence can be checked on its own.
"""

from __future__ import annotations

import numpy as np
import workers_data as W

import kvd_client

CHUNK = W.CHUNK


def seqs(seed: int, count: int, chunks: int) -> list:
    return W.seq_tokens(seed, [chunks * CHUNK] * count)


def _pages(spec: dict, seed: int, count: int, chunks: int) -> list:
    n = chunks * W.ppc(spec)
    pages = W.store_pages(spec, seed, count * n)
    return [pages[i * n:(i + 1) * n] for i in range(count)]


def store_seqs(runtime_dir: str, spec: dict, seed: int, count: int, chunks: int, model: str,
               flush: bool = True, timeout: float = 20.0) -> int:
    """Store ``count`` sequences one by one (flushing the disk tier after each when asked)."""
    pool = W.make_pool(spec, seed)
    total = 0
    try:
        with kvd_client.KvdClient(runtime_dir=runtime_dir, timeout=timeout,
                                  raise_errors=True).connect() as c:
            c.register_kv(pool, model=model)
            for tokens, pages in zip(seqs(seed, count, chunks), _pages(spec, seed, count, chunks)):
                total += c.store(tokens, pages)
                if flush:
                    control(runtime_dir, "flush_disk")
    finally:
        pool.close()
    return total


def load_seqs(runtime_dir: str, spec: dict, src_seed: int, count: int, chunks: int,
              model: str, lookup: bool = True) -> list:
    """Lookup (unless ``lookup`` is False: hit None) and load every sequence into other
    pages; what was loaded must be the storer's bytes and the pages not loaded keep their
    poison. Returns [(lookup, loaded)]."""
    src_pages = _pages(spec, src_seed, count, chunks)
    shadow = W.make_pool(spec, src_seed)
    pool = W.make_pool(spec, src_seed + 1)
    out = []
    try:
        with W.client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            for i, tokens in enumerate(seqs(src_seed, count, chunks)):
                before = W.poison(pool)
                lp = np.random.default_rng([src_seed, i, 3]).permutation(spec["num_pages"])
                lp = lp[:chunks * W.ppc(spec)]
                hit = c.lookup(tokens) if lookup else None
                loaded = c.load(tokens, lp)
                k = loaded // CHUNK
                want = W.read_rows(spec, shadow.tensors, src_pages[i], k * CHUNK) if k else None
                exp = W.expect_after_load(pool, spec, before, [(lp, want)] if k else [])
                W.assert_pool(pool, exp, f"load of sequence {i} ({k} chunks)")
                out.append((hit, loaded))
    finally:
        pool.close()
        shadow.close()
    return out


def control(runtime_dir: str, op: str) -> dict:
    from pathlib import Path

    from kvd_client.transport import Channel
    from kvd_protocol.runtime import control_endpoint
    ch = Channel(control_endpoint(Path(runtime_dir)), 30.0)
    try:
        return ch.request(op)
    finally:
        ch.close()


def slow_loader(runtime_dir: str, spec: dict, seed: int, report) -> None:
    """Store one sequence, leave it on disk only, then load it (slowly) until killed."""
    pool = W.make_pool(spec, seed)
    c = kvd_client.KvdClient(runtime_dir=runtime_dir, raise_errors=True, timeout=30).connect()
    c.register_kv(pool, model="disk/slow")
    tokens, pages = seqs(seed, 1, 2)[0], _pages(spec, seed, 1, 2)[0]
    c.store(tokens, pages)
    control(runtime_dir, "flush_disk")
    control(runtime_dir, "clear")
    report.send("loading")
    c.load(tokens, pages)  # the daemon's disk read sleeps; we are killed meanwhile
    report.send("loaded")
