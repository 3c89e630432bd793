"""Engine halves of tests/server/test_data_path.py that share chunks, run in spawned processes.

Every function here is a module-level function so a spawn-context pool can
run it; each plays an engine on the reference and helpers of
tests/workers_data.py. Covered: every layout x page size x dtype across
processes (``roundtrip``), prefix semantics, dedup across clients,
namespace and salt isolation, tensor-parallel shards.

Processes that must move in step share a ``multiprocessing.Manager``
barrier; a worker that fails aborts it, so its partners stop at once
instead of waiting for a timeout.
"""

from __future__ import annotations

import numpy as np
from workers_data import (
    CHUNK,
    assert_pool,
    assert_rows,
    client,
    expect_after_load,
    make_pool,
    poison,
    ppc,
    read_rows,
    seq_tokens,
    source_rows,
    store_pages,
)

BARRIER_S = 60.0    # a partner that does not arrive in this long has failed


def _in_step(barrier, fn, *args):
    """Run ``fn``; on failure break the barrier so partners stop waiting, then re-raise."""
    try:
        return fn(*args)
    except BaseException:
        barrier.abort()
        raise


# ---- 1. every layout x page size x dtype, across processes ------------------------

SEQ_LENGTHS = [2 * CHUNK + 5, CHUNK + 3]  # 3 whole chunks; partial tails are never cached


def roundtrip(runtime_dir: str, index: int, rounds: list, barrier) -> int:
    return _in_step(barrier, _roundtrip, runtime_dir, index, rounds, barrier)


def _roundtrip(runtime_dir: str, index: int, rounds: list, barrier) -> int:
    """Each round: store own sequences, then load the next process's into own pages.

    ``rounds[r]`` holds one spec per process (all equal, or different layouts of
    one namespace) and a base seed. Returns the token rows checked.
    """
    checked = 0
    nprocs = len(rounds[0]["specs"])
    with client(runtime_dir) as c:
        for rnd in rounds:
            spec = rnd["specs"][index]
            seed = rnd["seed"] * 100 + index
            pool = make_pool(spec, seed)
            reg = c.register_kv(pool, model=rnd["model"])
            whole = [n // CHUNK * CHUNK for n in SEQ_LENGTHS]
            pages = store_pages(spec, seed, sum(whole) // spec["page_size"])
            start = 0
            for toks, n in zip(seq_tokens(seed, SEQ_LENGTHS), whole):
                got = c.store(toks, pages[start:start + n // spec["page_size"]], reg=reg)
                assert got == n, f"{spec}: stored {got} of {n} tokens"
                start += n // spec["page_size"]
            barrier.wait(BARRIER_S)

            src = (index + 1) % nprocs
            src_spec, src_seed = rnd["specs"][src], rnd["seed"] * 100 + src
            src_pages = store_pages(src_spec, src_seed, sum(whole) // src_spec["page_size"])
            before = poison(pool)
            load_pages = np.random.default_rng([seed, 3]).permutation(spec["num_pages"])
            writes, start, lstart = [], 0, 0
            for toks, n in zip(seq_tokens(src_seed, SEQ_LENGTHS), whole):
                sp = src_pages[start:start + n // src_spec["page_size"]]
                lp = load_pages[lstart:lstart + n // spec["page_size"]]
                start += n // src_spec["page_size"]
                lstart += n // spec["page_size"]
                assert c.lookup(toks, reg=reg) == n, f"{spec}: lookup of process {src}'s tokens"
                got = c.load(toks, lp, reg=reg)
                assert got == n, f"{spec}: loaded {got} of {n} tokens"
                want = source_rows(src_spec, src_seed, sp, n)
                assert_rows(read_rows(spec, pool.tensors, lp, n), want,
                            f"{spec['layout']} ps={spec['page_size']} {spec['dtype']} (process "
                            f"{index} loading process {src}'s chunks)")
                writes.append((lp, want))
                checked += n
            exp = expect_after_load(pool, spec, before, writes)
            assert_pool(pool, exp, f"{spec['layout']} ps={spec['page_size']} {spec['dtype']} "
                                   f"(process {index} loading process {src}'s chunks)")
            c.unregister(reg)
            pool.close()
    return checked


# ---- 2. prefix semantics ----------------------------------------------------------

def prefix_probe(runtime_dir: str, spec: dict, src_seed: int, tokens, model: str,
                 changes: list) -> dict:
    """For each token position in ``changes``: lookup and load the changed sequence.

    Checks the loaded chunks hold the storer's bytes and the pages of the chunks
    not loaded keep their poison. Returns {position: (lookup, loaded)}.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens) // CHUNK
    src_pages = store_pages(spec, src_seed, n * ppc(spec))
    src = source_rows(spec, src_seed, src_pages, n * CHUNK)
    out = {}
    pool = make_pool(spec, src_seed + 1)
    try:
        with client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            for pos in changes:
                changed = tokens.copy()
                if pos is not None:
                    changed[pos] = (changed[pos] + 1) % 2**32
                before = poison(pool)
                lp = np.random.default_rng([src_seed, pos or 0]).permutation(spec["num_pages"])
                lp = lp[:n * ppc(spec)]
                hit = c.lookup(changed)
                loaded = c.load(changed, lp)
                out[pos] = (hit, loaded)
                k = loaded // CHUNK
                exp = expect_after_load(pool, spec, before, [(lp, src[:k * CHUNK])])
                assert_pool(pool, exp, f"load of the sequence changed at token {pos}")
    finally:
        pool.close()
    return out


# ---- 3. dedup across clients -------------------------------------------------------

def store_in_step(runtime_dir: str, spec: dict, seed: int, tokens, model: str, barrier) -> int:
    """Register, wait for every partner, then store at the same moment."""
    def go():
        pool = make_pool(spec, seed)
        try:
            with client(runtime_dir) as c:
                c.register_kv(pool, model=model)
                barrier.wait(BARRIER_S)
                n = len(tokens) // CHUNK
                return c.store(tokens, store_pages(spec, seed, n * ppc(spec)))
        finally:
            pool.close()
    return _in_step(barrier, go)


def load_check(runtime_dir: str, spec: dict, seed: int, tokens, model: str,
               candidate_seeds: list, tp_size: int = 1, tp_rank: int = 0) -> list:
    """Load ``tokens`` into a fresh pool; return, per chunk, the candidate seed whose
    source bytes it holds (None if none). Pages not loaded must keep their poison."""
    n = len(tokens) // CHUNK
    pool = make_pool(spec, seed)
    try:
        with client(runtime_dir) as c:
            c.register_kv(pool, model=model, tp_size=tp_size, tp_rank=tp_rank)
            before = poison(pool)
            lp = np.random.default_rng([seed, 4]).permutation(spec["num_pages"])[:n * ppc(spec)]
            loaded = c.load(tokens, lp)
            assert loaded == n * CHUNK, f"loaded {loaded} of {n * CHUNK} tokens"
            got = read_rows(spec, pool.tensors, lp, n * CHUNK)
            exp = expect_after_load(pool, spec, before, [(lp, got)])
            assert_pool(pool, exp, "bytes outside the loaded pages")
            owners = []
            cands = {s: source_rows(spec, s, store_pages(spec, s, n * ppc(spec)), n * CHUNK)
                     for s in candidate_seeds}
            for k in range(n):
                sl = slice(k * CHUNK, (k + 1) * CHUNK)
                owners.append(next((s for s, rows in cands.items()
                                    if np.array_equal(rows[sl], got[sl])), None))
            return owners
    finally:
        pool.close()


# ---- 4. namespace and salt isolation ----------------------------------------------

def isolation_probe(runtime_dir: str, base: dict, tokens, variants: dict) -> dict:
    """Lookup (and load) ``tokens`` under each variant; returns {name: (lookup, loaded)}.

    A variant is a dict of overrides: spec keys (dtype, heads, layers, ...), ``model``,
    ``salt``, ``tp_size``, ``first_layer``, ``fingerprint``. A miss must leave the pool
    untouched.
    """
    out = {}
    with client(runtime_dir) as c:
        for name, v in variants.items():
            spec = {**base, **{k: v[k] for k in base if k in v}}
            pool = make_pool(spec, 7)
            try:
                reg = c.register_kv(pool, model=v.get("model", base["model"]),
                                    tp_size=v.get("tp_size", 1),
                                    first_layer=v.get("first_layer", 0),
                                    fingerprint=v.get("fingerprint", ""))
                before = poison(pool)
                n = len(tokens) // CHUNK
                hit = c.lookup(tokens, salt=v.get("salt"), reg=reg)
                loaded = c.load(tokens, np.arange(n * ppc(spec)), salt=v.get("salt"), reg=reg)
                if loaded == 0:
                    assert_pool(pool, before, f"variant {name}: a miss wrote into the pool")
                out[name] = (hit, loaded)
                c.unregister(reg)
            finally:
                pool.close()
    return out


# ---- 6. tensor parallel ---------------------------------------------------------------

def tp_rank_flow(runtime_dir: str, spec: dict, rank: int, seeds: list, tokens, barrier) -> dict:
    return _in_step(barrier, _tp_rank_flow, runtime_dir, spec, rank, seeds, tokens, barrier)


def _tp_rank_flow(runtime_dir, spec, rank, seeds, tokens, barrier) -> dict:
    """Two ranks of one tp_size=2 engine. MHA: each stores its own shard, rank 0
    first; MLA: only rank 0 stores the latent, rank 1 reads it (then stores:
    dedup). Returns what each rank saw at each step."""
    mla = spec["layout"].endswith("mla")
    n = len(tokens) // CHUNK
    own_pages = store_pages(spec, seeds[rank], n * ppc(spec))
    seen = {}
    pool = make_pool(spec, seeds[rank])
    try:
        with client(runtime_dir) as c:
            c.register_kv(pool, model="tp-model", tp_size=2, tp_rank=rank)
            barrier.wait(BARRIER_S)
            if rank == 0:
                seen["store"] = c.store(tokens, own_pages)
            barrier.wait(BARRIER_S)
            spare = np.setdiff1d(np.arange(spec["num_pages"]), own_pages)[:n * ppc(spec)]
            seen["lookup_one_stored"] = c.lookup(tokens)
            before = pool.raw.copy()
            seen["load_one_stored"] = c.load(tokens, spare)
            if seen["load_one_stored"] == 0:
                assert_pool(pool, before, f"rank {rank}: a load that missed wrote into the pool")
            barrier.wait(BARRIER_S)
            if rank == 1:
                seen["store"] = c.store(tokens, own_pages)
            barrier.wait(BARRIER_S)
            seen["lookup_all_stored"] = c.lookup(tokens)
            before = poison(pool)
            seen["load_all_stored"] = c.load(tokens, spare)
            got = read_rows(spec, pool.tensors, spare, n * CHUNK)
            want_seed = seeds[0] if mla else seeds[rank]
            want = source_rows(spec, want_seed, store_pages(spec, want_seed, n * ppc(spec)), n * CHUNK)
            other = source_rows(spec, seeds[1 - rank],
                                store_pages(spec, seeds[1 - rank], n * ppc(spec)), n * CHUNK)
            seen["own_shard"] = bool(np.array_equal(got, want))
            seen["other_shard"] = bool(np.array_equal(got, other))
            assert_pool(pool, expect_after_load(pool, spec, before, [(spare, want)]),
                        f"rank {rank} load")
            if mla and rank == 1:
                # an MLA engine of another TP size shares the latent chunks too
                reg1 = c.register_kv(pool, model="tp-model", tp_size=1, tp_rank=0)
                seen["lookup_tp1"] = c.lookup(tokens, reg=reg1)
            barrier.wait(BARRIER_S)
    finally:
        pool.close()
    return seen
