"""Client-process halves of the partial-chunk tests (tests/server/test_partial.py).

Run in spawned processes against a real daemon, like tests/workers_data.py, whose
helpers build pools, regenerate a storer's bytes and compute what a pool must
hold after a load: the bytes are checked against the storer's seed, never against
kvd's copy code.
"""

from __future__ import annotations

import numpy as np
import workers_data as W

CHUNK = W.CHUNK


def partial_loads(runtime_dir: str, spec: dict, src_seed: int, tokens, model: str,
                  layerwise: bool) -> dict:
    """Load every prefix of ``tokens``'s stored chunks that ends inside the last chunk at a
    page boundary (``tail_pages`` 1 .. pages_per_chunk - 1) into a poisoned pool; each must
    bring exactly the storer's rows of its tokens and write no other byte. Returns
    {tail_pages: tokens loaded}."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n, ppc, ps = len(tokens) // CHUNK, W.ppc(spec), spec["page_size"]
    src = W.source_rows(spec, src_seed, W.store_pages(spec, src_seed, n * ppc), n * CHUNK)
    out = {}
    pool = W.make_pool(spec, src_seed + 7)
    try:
        with W.client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            for tail in range(1, ppc):
                before = W.poison(pool)
                lp = np.random.default_rng([src_seed, tail]).permutation(spec["num_pages"])
                lp = lp[:(n - 1) * ppc + tail]
                t = c.submit_load(tokens, lp, layerwise=layerwise, tail_pages=tail)
                if layerwise:
                    for layer in range(spec["layers"]):
                        c.wait_for_layer(layer, t)
                out[tail] = c._blocking(t)
                want = (n - 1) * CHUNK + tail * ps
                exp = W.expect_after_load(pool, spec, before, [(lp, src[:want])])
                W.assert_pool(pool, exp, f"a load of {n - 1} chunks and {tail} pages")
    finally:
        pool.close()
    return out


def partial_load_of_a_miss(runtime_dir: str, spec: dict, seed: int, tokens, model: str) -> int:
    """A partial load whose last chunk is not stored loads the whole chunks before it and
    leaves every page of the last chunk (and the rest of the pool) alone."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n, ppc = len(tokens) // CHUNK, W.ppc(spec)
    pool = W.make_pool(spec, seed)
    try:
        with W.client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            before = W.poison(pool)
            lp = np.random.default_rng([seed, 9]).permutation(spec["num_pages"])[:(n - 1) * ppc + 1]
            loaded = c.load(tokens[:(n - 1) * CHUNK], lp[:(n - 1) * ppc])
            assert loaded == (n - 1) * CHUNK
            got = W.read_rows(spec, pool.tensors, lp, loaded)
            before = W.poison(pool)
            loaded = c._blocking(c.submit_load(tokens, lp, tail_pages=1))
            exp = W.expect_after_load(pool, spec, before, [(lp, got)])
            W.assert_pool(pool, exp, "a partial load whose last chunk is a miss")
            return loaded
    finally:
        pool.close()
