"""Client-side halves of tests/tiers/test_remote_tier.py and test_remote_secret.py, run in
spawned processes.

Sequences, pools and the byte checks are those of tests/workers_disk.py
(expected bytes regenerated from the storer's seed, read by the engine's own
tensor indexing). Here: the store names of a sequence's chunks (what a
test corrupts in the store), lookups timed from the engine's side, and
loads whose bytes are not checked (values forged in the store).
"""

from __future__ import annotations

import time

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
