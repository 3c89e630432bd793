"""Client-process halves of the partial-chunk tests (tests/server/test_partial.py).

Run in spawned processes against a real daemon, like tests/workers_data.py, whose
helpers build pools, regenerate a storer's bytes and compute what a pool must
hold after a load: the bytes are checked against the storer's seed, never against
kvd's copy code.
"""

from __future__ import annotations

import numpy as np
import workers_data as W

from kvd_client import ChunkKeys
from kvd_protocol.keys import chain_root, namespace_digest, part_key

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



def tail_key(c, reg, tokens, n_tokens: int) -> bytes:
    """The partial key of ``tokens``'s first ``n_tokens`` past its whole chunks."""
    n = len(tokens) // CHUNK
    prev = c.keys(tokens[:n * CHUNK], reg=reg)[-1] if n else chain_root(namespace_digest(reg.namespace))
    return part_key(prev, tokens[n * CHUNK:n * CHUNK + n_tokens])


def store_with_tail(runtime_dir: str, spec: dict, seed: int, tokens, model: str, tail: int) -> int:
    """Store the whole chunks of ``tokens`` and, as a partial entry (protocol §8.5), its first
    ``tail`` tokens after them (``tokens`` is cut there), from the storer's pages
    (``store_pages``: the tail's pages follow the chunks'). Returns tokens cached."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n, ppc, ps = len(tokens) // CHUNK, W.ppc(spec), spec["page_size"]
    pages = W.store_pages(spec, seed, n * ppc + tail // ps)
    pool = W.make_pool(spec, seed)
    try:
        with W.client(runtime_dir) as c:
            reg = c.register_kv(pool, model=model)
            stored = c.store(tokens[:n * CHUNK], pages[:n * ppc], reg=reg) if n else 0
            t = c.submit_store(ChunkKeys([tail_key(c, reg, tokens, tail)]), pages[n * ppc:],
                               reg=reg, part_tokens=tail)
            return stored + c._blocking(t)
    finally:
        pool.close()


def load_with_tail(runtime_dir: str, spec: dict, src_seed: int, tokens, model: str,
                   tail: int) -> dict:
    """In a poisoned pool: look ``tokens`` up with partial candidates (the tail one page
    longer, the tail, one page shorter: the stored one must answer), load its whole chunks
    and its partial entry; the pages hold exactly the storer's rows, nothing else moved.
    Then the reads that must miss: the partial key as a whole chunk, or as another length."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n, ppc, ps = len(tokens) // CHUNK, W.ppc(spec), spec["page_size"]
    src_pages = W.store_pages(spec, src_seed, n * ppc + tail // ps)
    src = W.source_rows(spec, src_seed, src_pages, n * CHUNK + tail)
    pool = W.make_pool(spec, src_seed + 3)
    out = {}
    try:
        with W.client(runtime_dir) as c:
            reg = c.register_kv(pool, model=model)
            chain = c.keys(tokens[:n * CHUNK], reg=reg)
            counts = [t for t in (tail + ps, tail, tail - ps) if 0 < t < CHUNK]
            cands = [tail_key(c, reg, tokens, t) for t in counts]
            look = c.submit_lookup(ChunkKeys(chain + cands), 1000, reg=reg, part_tokens=counts)
            out["lookup"], lease = look.result()
            out["part"] = look.part
            c.release(lease)
            out["plain_lookup"] = c.lookup(ChunkKeys(chain + cands[:1]), reg=reg)
            before = W.poison(pool)
            perm = np.random.default_rng([src_seed, 5]).permutation(spec["num_pages"])
            lp = perm[:n * ppc + tail // ps]
            out["loaded"] = c.load(ChunkKeys(chain), lp[:n * ppc], reg=reg) if n else 0
            key = tail_key(c, reg, tokens, tail)
            out["part_loaded"] = c._blocking(c.submit_load(ChunkKeys([key]), lp[n * ppc:], reg=reg,
                                                           part_tokens=tail))
            exp = W.expect_after_load(pool, spec, before, [(lp, src)])
            W.assert_pool(pool, exp, "whole chunks and a partial entry")
            before = W.poison(pool)
            out["as_chunk"] = c.load(ChunkKeys([key]), perm[:ppc], reg=reg)
            if tail > ps:
                out["as_shorter"] = c._blocking(c.submit_load(
                    ChunkKeys([key]), lp[:tail // ps - 1], reg=reg, part_tokens=tail - ps))
            W.assert_pool(pool, before, "reads of a partial entry that must miss")
    finally:
        pool.close()
    return out
