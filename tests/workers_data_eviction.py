"""Engine halves of tests/server/test_data_path.py under memory pressure, run in spawned processes.

Every function here is a module-level function so a spawn-context pool can
run it; each plays an engine on the reference and helpers of
tests/workers_data.py. Covered: eviction keeps memory bounded and the
newest chunks (LRU), lookups and loads stop at an evicted middle chunk,
leased chunks are never evicted, a lease is consumed by its load or expires.
"""

from __future__ import annotations

import time

import numpy as np
from workers_data import (
    CHUNK,
    assert_pool,
    client,
    daemon_stats,
    expect_after_load,
    make_pool,
    poison,
    ppc,
    read_rows,
    seq_tokens,
    source_rows,
    store_pages,
)

import kvd_client
from kvd_protocol.errors import NoSpace, NotFound


# ---- 5. eviction under memory pressure ---------------------------------------------

def evict_middle_chunk(runtime_dir: str, spec: dict, seed: int, chain, fillers: list,
                       model: str) -> list:
    """Store ``chain`` then one-chunk fillers until the tier is full; make chunk 0 of
    the chain recent with a lookup of its first chunk only; store one more filler,
    which must evict chunk 1 (now the least recently used). Returns the lookups."""
    n = len(chain) // CHUNK
    pages = store_pages(spec, seed, (n + len(fillers)) * ppc(spec))
    seen = []
    pool = make_pool(spec, seed)
    try:
        with client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            assert c.store(chain, pages[:n * ppc(spec)]) == n * CHUNK
            seen.append(c.lookup(chain))
            for i, toks in enumerate(fillers):
                if i == len(fillers) - 1:
                    seen.append(c.lookup(chain[:CHUNK]))
                at = (n + i) * ppc(spec)
                assert c.store(toks, pages[at:at + ppc(spec)]) == CHUNK
            seen.append(c.lookup(chain))
    finally:
        pool.close()
    return seen


def eviction_store(runtime_dir: str, spec: dict, seed: int, n_seqs: int, touch_at: int) -> dict:
    """Store ``n_seqs`` one-chunk sequences one by one, reading stats after each.

    After storing sequence ``touch_at`` (the tier then holds ``touch_at`` chunks and
    is full), sequence 0 is looked up to make it recently used; storing sequence
    ``touch_at`` must then evict sequence 1, not 0.
    """
    toks = seq_tokens(seed, [CHUNK] * n_seqs)
    pages = store_pages(spec, seed, n_seqs * ppc(spec))
    trace, lru = [], {}
    pool = make_pool(spec, seed)
    try:
        with client(runtime_dir) as c:
            c.register_kv(pool, model="evict")
            for i in range(n_seqs):
                if i == touch_at:
                    lru["seq0_before"] = c.lookup(toks[0])
                got = c.store(toks[i], pages[i * ppc(spec):(i + 1) * ppc(spec)])
                assert got == CHUNK, f"store of sequence {i} returned {got}"
                host = daemon_stats(runtime_dir)["tiers"]["host"]
                trace.append(host)
                if i == touch_at:
                    lru["seq0_after"] = c.lookup(toks[0])
                    lru["seq1_after"] = c.lookup(toks[1])
    finally:
        pool.close()
    return {"trace": trace, "lru": lru}


def eviction_check(runtime_dir: str, spec: dict, src_seed: int, n_seqs: int) -> list:
    """Lookup every sequence; load each hit and check it bit-exact. Returns hit tokens."""
    toks = seq_tokens(src_seed, [CHUNK] * n_seqs)
    pages = store_pages(spec, src_seed, n_seqs * ppc(spec))
    hits = []
    pool = make_pool(spec, src_seed + 1)
    try:
        with client(runtime_dir) as c:
            c.register_kv(pool, model="evict")
            for i in range(n_seqs):
                hits.append(c.lookup(toks[i]))
            for i in range(n_seqs):
                if not hits[i]:
                    continue
                before = poison(pool)
                lp = np.random.default_rng([src_seed, i]).permutation(spec["num_pages"])[:ppc(spec)]
                assert c.load(toks[i], lp) == CHUNK, f"sequence {i} hit but did not load"
                src = source_rows(spec, src_seed, pages[i * ppc(spec):(i + 1) * ppc(spec)], CHUNK)
                assert_pool(pool, expect_after_load(pool, spec, before, [(lp, src)]),
                            f"load of sequence {i}")
    finally:
        pool.close()
    return hits


def pinned_pressure(runtime_dir: str, spec: dict, seed: int, n_fit: int) -> dict:
    """Fill the tier, lease every chunk, then store more: no_space, nothing evicted;
    release one lease and the store succeeds by evicting exactly that chunk. The
    leased chunks still load bit-exact with their leases."""
    toks = seq_tokens(seed, [CHUNK] * (n_fit + 1))
    pages = store_pages(spec, seed, (n_fit + 1) * ppc(spec))
    pg = [pages[i * ppc(spec):(i + 1) * ppc(spec)] for i in range(n_fit + 1)]
    out = {}
    pool = make_pool(spec, seed)
    try:
        with client(runtime_dir) as c:
            c.register_kv(pool, model="pinned")
            for i in range(n_fit):
                assert c.store(toks[i], pg[i]) == CHUNK
            leases = []
            for i in range(n_fit):
                hit, lease = c.lookup_lease(toks[i], 30000)
                assert hit == CHUNK and lease is not None
                leases.append(lease)
            before = daemon_stats(runtime_dir)["tiers"]["host"]
            try:
                c.store(toks[n_fit], pg[n_fit])
                out["full_store"] = "stored"
            except NoSpace:
                out["full_store"] = "no_space"
            out["host_before"], out["host_after"] = before, daemon_stats(runtime_dir)["tiers"]["host"]
            out["hits_while_pinned"] = [c.lookup(t) for t in toks[:n_fit]]
            c.release(leases[0])
            out["store_after_release"] = c.store(toks[n_fit], pg[n_fit])
            out["hits_after"] = [c.lookup(t) for t in toks]
            # the other leased chunks still load, bit-exact, through their leases
            target = poison(pool)
            spare = np.setdiff1d(np.arange(spec["num_pages"]), pages)
            writes = []
            for i in range(1, n_fit):
                lp = spare[(i - 1) * ppc(spec):i * ppc(spec)]
                assert c.load(toks[i], lp, lease=leases[i]) == CHUNK
                writes.append((lp, source_rows(spec, seed, pg[i], CHUNK)))
            # the pool was poisoned after the stores, so source rows come from the seed
            assert_pool(pool, expect_after_load(pool, spec, target, writes), "leased loads")
            out["leases_left"] = daemon_stats(runtime_dir)["leases"]
    finally:
        pool.close()
    return out


# ---- 7. leases ------------------------------------------------------------------------

def lease_flow(runtime_dir: str, spec: dict, seed: int) -> dict:
    toks = seq_tokens(seed, [3 * CHUNK])[0]
    pages = store_pages(spec, seed, 3 * ppc(spec))
    out = {}
    pool = make_pool(spec, seed)
    try:
        with client(runtime_dir) as c:
            c.register_kv(pool, model="lease")
            assert c.store(toks, pages) == 3 * CHUNK
            src = read_rows(spec, pool.tensors, pages, 3 * CHUNK)
            spare = np.setdiff1d(np.arange(spec["num_pages"]), pages)[:3 * ppc(spec)]
            hit, lease = c.lookup_lease(toks, 10000)
            out["hit"], out["lease"] = hit, lease
            out["leases_held"] = daemon_stats(runtime_dir)["leases"]
            before = poison(pool)
            out["load"] = c.load(toks, spare, lease=lease)
            assert_pool(pool, expect_after_load(pool, spec, before, [(spare, src)]), "leased load")
            out["leases_after_load"] = daemon_stats(runtime_dir)["leases"]
            for what, call in (("second_load", lambda: c.load(toks, spare, lease=lease)),
                               ("release_consumed", lambda: c.release(lease))):
                try:
                    call()
                    out[what] = "ok"
                except NotFound as exc:
                    out[what] = exc.code
            # a lease that expires is gone as well
            _, short = c.lookup_lease(toks, 200)
            time.sleep(0.8)
            try:
                c.load(toks, spare, lease=short)
                out["expired_load"] = "ok"
            except NotFound as exc:
                out["expired_load"] = exc.code
            out["leases_end"] = daemon_stats(runtime_dir)["leases"]
            # without raise_errors the consumed lease is a plain miss for the engine
            quiet = kvd_client.KvdClient(runtime_dir=runtime_dir, timeout=20, heartbeat=False).connect()
            try:
                quiet.register_kv(pool, model="lease")
                out["quiet_second_load"] = quiet.load(toks, spare, lease=lease)
            finally:
                quiet.close()
    finally:
        pool.close()
    return out
