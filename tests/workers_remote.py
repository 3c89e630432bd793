"""Client-side halves of tests/tiers/test_remote_tier.py and test_remote_secret.py, run in
spawned processes.

Sequences, pools and the byte checks are those of tests/workers_disk.py
(expected bytes regenerated from the storer's seed, read by the engine's own
tensor indexing). Here: the store names of a sequence's chunks (what a
test corrupts in the store), lookups timed from the engine's side, loads
whose bytes are not checked (values forged in the store), and layer-wise
loads checked layer by layer as each layer's word arrives.
"""

from __future__ import annotations

import time

import numpy as np
import workers_data as W
import workers_disk as D

from kvd_protocol.keys import namespace_digest


def store_names(runtime_dir: str, spec: dict, seed: int, count: int, chunks: int, model: str,
                prefix: str) -> list:
    """The remote store's names of every chunk of the sequences (in order)."""
    pool = W.make_pool(spec, seed)
    try:
        with W.client(runtime_dir) as c:
            reg = c.register_kv(pool, model=model)
            ns = namespace_digest(reg.namespace).hex()
            return [f"{prefix}/{ns}/{k.hex()}" for tokens in D.seqs(seed, count, chunks)
                    for k in c.keys(tokens)]
    finally:
        pool.close()


def timed_lookups(runtime_dir: str, spec: dict, seed: int, count: int, chunks: int,
                  model: str) -> list:
    """(tokens hit, seconds) of a lookup of each sequence, as the engine waits for it."""
    pool = W.make_pool(spec, seed)
    out = []
    try:
        with W.client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            for tokens in D.seqs(seed, count, chunks):
                t0 = time.perf_counter()
                hit = c.lookup(tokens)
                out.append((hit, time.perf_counter() - t0))
    finally:
        pool.close()
    return out


def load_unchecked(runtime_dir: str, spec: dict, seed: int, count: int, chunks: int,
                   model: str) -> list:
    """(tokens hit, tokens loaded) of each sequence, bytes not checked: what a node served
    from values someone else wrote."""
    pool = W.make_pool(spec, seed + 1)
    try:
        with W.client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            return [(c.lookup(tokens), c.load(tokens, range(chunks * W.ppc(spec))))
                    for tokens in D.seqs(seed, count, chunks)]
    finally:
        pool.close()


def load_prefix(runtime_dir: str, spec: dict, seed: int, count: int, chunks: int, local: int,
                model: str) -> list:
    """Load the first ``local`` chunks of each sequence (bytes not checked here): the node
    holds them in its host tier afterwards, the rest stays remote."""
    pool = W.make_pool(spec, seed + 2)
    try:
        with W.client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            out = []
            for tokens in D.seqs(seed, count, chunks):
                head = tokens[:local * W.CHUNK]
                out.append((c.lookup(head), c.load(head, range(local * W.ppc(spec)))))
            return out
    finally:
        pool.close()


def load_layerwise(runtime_dir: str, spec: dict, src_seed: int, count: int, chunks: int,
                   model: str, expect: list) -> list:
    """Layer-wise loads of each sequence (no lookup first) into other pages: as each layer's
    word arrives, that layer of the ``expect[i]`` chunks loaded must already hold the
    storer's bytes; at the end every loaded byte is the storer's and the pages not loaded
    keep their poison. Returns the tokens each load loaded."""
    src_pages = D._pages(spec, src_seed, count, chunks)
    shadow = W.make_pool(spec, src_seed)
    pool = W.make_pool(spec, src_seed + 3)
    out = []
    try:
        with W.client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            for i, tokens in enumerate(D.seqs(src_seed, count, chunks)):
                before = W.poison(pool)
                lp = np.random.default_rng([src_seed, i, 5]).permutation(spec["num_pages"])
                lp = lp[:chunks * W.ppc(spec)]
                n = expect[i] * W.CHUNK
                want = W.read_rows(spec, shadow.tensors, src_pages[i], n)
                t = c.submit_load(tokens, lp, layerwise=True)
                for layer in range(spec["layers"]):
                    c.wait_for_layer(layer, t)
                    got = W.read_rows(spec, pool.tensors, lp, n)[:, layer]
                    if (got != want[:, layer]).any():  # wrong bytes, or a shorter load
                        t.wait()
                        if t.tokens == n:
                            W.assert_rows(got, want[:, layer], f"sequence {i} layer {layer}")
                        break
                t.wait()
                assert t.error is None, t.error
                if t.tokens != n:
                    return out + [t.tokens]  # the test says why, with the daemon's stats
                exp = W.expect_after_load(pool, spec, before, [(lp, want)])
                W.assert_pool(pool, exp, f"layer-wise load of sequence {i}")
                out.append(t.tokens)
    finally:
        pool.close()
        shadow.close()
    return out
