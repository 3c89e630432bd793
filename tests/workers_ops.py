"""Client-side halves of the operations tests (metrics, ``kvd top``), run in spawned processes.

``metered_run`` plays an engine whose every request is known in advance, so
the test can check that the daemon's counters moved by exactly that much.
"""

from __future__ import annotations

import numpy as np
import workers_data as W

from kvd_protocol.errors import OutOfRange

CHUNK = W.CHUNK


def metered_run(runtime_dir: str, spec: dict, seed: int, n: int, m: int, connected, proceed) -> dict:
    """Register, then (once ``proceed`` is set): store n chunks, store them again (dedup), look
    them up (n hits), look up m other chunks (m misses), load the n chunks into other pages
    (checked), and one load with page ids out of range (an ``out_of_range`` error)."""
    pool = W.make_pool(spec, seed)
    try:
        with W.client(runtime_dir) as c:
            c.register_kv(pool, model="metered")
            connected.set()
            if not proceed.wait(60):
                raise TimeoutError("the test never said proceed")
            tokens, other = W.seq_tokens(seed, [n * CHUNK, m * CHUNK])
            src = W.store_pages(spec, seed, n * W.ppc(spec))
            dst = np.setdiff1d(np.arange(spec["num_pages"]), src)[:n * W.ppc(spec)]
            out = {"stored": c.store(tokens, src), "restored": c.store(tokens, src),
                   "hits": c.lookup(tokens), "other_hits": c.lookup(other),
                   "loaded": c.load(tokens, dst)}
            want = W.source_rows(spec, seed, src, n * CHUNK)
            assert np.array_equal(W.read_rows(spec, pool.tensors, dst, n * CHUNK), want)
            try:
                c.load(tokens, np.full(n * W.ppc(spec), spec["num_pages"] + 5))
                out["bad_load"] = "accepted"
            except OutOfRange:
                out["bad_load"] = "out_of_range"
            return out
    finally:
        pool.close()


def busy_engine(runtime_dir: str, spec: dict, seed: int, stop) -> dict:
    """Store, look up and load two chunks over and over (new tokens each round) until
    ``stop`` is set; returns how many rounds ran."""
    pool = W.make_pool(spec, seed)
    rounds = 0
    try:
        with W.client(runtime_dir) as c:
            c.register_kv(pool, model="busy")
            src, dst = np.arange(2 * W.ppc(spec)), np.arange(2 * W.ppc(spec), 4 * W.ppc(spec))
            while not stop.is_set():
                tokens = W.seq_tokens(seed + rounds, [2 * CHUNK])[0]
                c.store(tokens, src)
                c.lookup(tokens)
                c.load(tokens, dst)
                rounds += 1
        return {"rounds": rounds}
    finally:
        pool.close()
