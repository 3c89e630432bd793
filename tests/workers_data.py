"""Client-side halves of tests/server/test_data_path.py, run in spawned processes.

Every function here is a module-level function so a spawn-context pool can
run it. Each one plays an engine: it owns a ``SharedKVPool`` filled with
bytes drawn from a seed, talks to a real daemon through ``KvdClient`` and
checks what lands in its pool.

Expected bytes never come from kvd: ``token_row`` reads a token row from
the engine's numpy tensors by the engine's own indexing (the tensor shapes
of DESIGN.md's layout table), and a storer's bytes are regenerated in the
checking process from the storer's seed (``make_pool``), so the daemon's
gather/scatter is checked against an independent reference.

Processes that must move in step share a ``multiprocessing.Manager``
barrier; a worker that fails aborts it, so its partners stop at once
instead of waiting for a timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import kvd_client
from kvd_client.transport import Channel
from kvd_protocol.errors import NoSpace, NotFound
from kvd_protocol.runtime import control_endpoint

CHUNK = 16          # the test daemons' chunk_tokens
BARRIER_S = 60.0    # a partner that does not arrive in this long has failed
POISON_SEED = 0xA5


# ---- the independent reference --------------------------------------------------

def expected_shapes(layout: str, layers: int, pages: int, ps: int, heads: int, dim: int) -> list:
    """Tensor shapes each engine allocates (DESIGN.md, 'Engine-side layouts')."""
    if layout == "vllm_flash_attn":
        return [(2, pages, ps, heads, dim)] * layers
    if layout == "vllm_flashinfer":
        return [(pages, 2, ps, heads, dim)] * layers
    if layout == "vllm_mla":
        return [(pages, ps, dim)] * layers
    if layout == "vllm_kv_blocks":
        return [(pages, heads, ps, 2 * dim)] * layers
    if layout == "sglang_mha":
        return [(pages * ps, heads, dim)] * (2 * layers)  # K0, V0, K1, V1, ...
    if layout == "sglang_mla":
        return [(pages * ps, 1, dim)] * layers
    if layout == "page_first":
        return [(pages, layers, 2, ps, heads, dim)]
    if layout == "opaque":
        return [(pages, heads, ps, dim)] * layers
    raise AssertionError(f"no reference for layout {layout!r}")


def token_row(layout: str, tensors: list, layer: int, plane: int, page: int, slot: int,
              page_size: int) -> np.ndarray:
    """uint8 view of the (heads x dim) row of token ``slot`` of page ``page``, (layer, plane):
    1-d, or ``[heads, dim bytes]`` where the heads of a row are apart (vLLM GPU blocks,
    whose ``tensors`` are the logical ``[blocks, heads, block_size, 2 * dim]`` views)."""
    if layout == "vllm_flash_attn":      # per layer [2, blocks, block_size, heads, dim]
        row = tensors[layer][plane, page, slot]
    elif layout == "vllm_flashinfer":    # per layer [blocks, 2, block_size, heads, dim]
        row = tensors[layer][page, plane, slot]
    elif layout == "vllm_mla":           # per layer [blocks, block_size, latent]
        assert plane == 0
        row = tensors[layer][page, slot]
    elif layout.startswith("vllm_kv_blocks"):  # per layer [blocks, heads, block_size, 2 * dim]
        half = tensors[layer].shape[-1] // 2   # K: each head's first half, V: its second
        row = tensors[layer][page, :, slot, plane * half:(plane + 1) * half]
        out = row.view(np.uint8)
        assert np.shares_memory(out, row)
        return out
    elif layout == "sglang_mha":         # K and V per layer [tokens, heads, dim]
        row = tensors[2 * layer + plane][page * page_size + slot]
    elif layout == "sglang_mla":         # per layer [tokens, 1, latent]
        assert plane == 0
        row = tensors[layer][page * page_size + slot]
    elif layout == "page_first":         # [pages, layers, 2, page_size, heads, dim]
        row = tensors[0][page, layer, plane, slot]
    elif layout == "opaque":             # per layer [blocks, heads, block_size, dim]: whole pages
        assert plane == 0                # move byte for byte; "row" t is the page's t-th slice
        row = tensors[layer][page].reshape(page_size, -1)[slot]
    else:
        raise AssertionError(f"no reference for layout {layout!r}")
    out = row.view(np.uint8).reshape(-1)
    assert np.shares_memory(out, row)
    return out


def planes(spec: dict) -> int:
    return 1 if spec["layout"].endswith("mla") or spec["layout"] == "opaque" else 2


def ppc(spec: dict) -> int:
    return CHUNK // spec["page_size"]


def make_pool(spec: dict, seed: int) -> kvd_client.SharedKVPool:
    """The pool of ``spec`` filled with the random bytes of ``seed`` (reproducible)."""
    pool = kvd_client.SharedKVPool(spec["layout"], spec["layers"], spec["num_pages"],
                                   spec["page_size"], spec["heads"], spec["dim"], spec["dtype"])
    shapes = expected_shapes(spec["layout"], spec["layers"], spec["num_pages"], spec["page_size"],
                             spec["heads"], spec["dim"])
    assert [t.shape for t in pool.tensors] == shapes, f"{spec['layout']} pool has unexpected shapes"
    pool.raw[:] = np.random.default_rng(seed).integers(0, 256, pool.raw.size, dtype=np.uint8)
    return pool


def store_pages(spec: dict, seed: int, n: int) -> np.ndarray:
    """The random distinct pages a storer with ``seed`` takes its chunks from."""
    return np.random.default_rng([seed, 1]).permutation(spec["num_pages"])[:n]


def seq_tokens(seed: int, lengths: list) -> list:
    rng = np.random.default_rng([seed, 2])
    return [rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.int64) for n in lengths]


def read_rows(spec: dict, tensors: list, pages, n_tokens: int) -> np.ndarray:
    """[token, layer, plane, row bytes] of ``n_tokens`` tokens kept in ``pages``."""
    ps = spec["page_size"]
    rows = None
    for t in range(n_tokens):
        for layer in range(spec["layers"]):
            for plane in range(planes(spec)):
                r = token_row(spec["layout"], tensors, layer, plane, int(pages[t // ps]), t % ps,
                              ps).reshape(-1)
                if rows is None:
                    rows = np.empty((n_tokens, spec["layers"], planes(spec), r.size), np.uint8)
                rows[t, layer, plane] = r
    return rows


def source_rows(spec: dict, seed: int, pages, n_tokens: int) -> np.ndarray:
    """The rows a storer with ``seed`` held in ``pages``, regenerated here."""
    shadow = make_pool(spec, seed)
    try:
        return read_rows(spec, shadow.tensors, pages, n_tokens)
    finally:
        shadow.close()


def poison(pool) -> np.ndarray:
    pool.raw[:] = np.random.default_rng(POISON_SEED).integers(0, 256, pool.raw.size, dtype=np.uint8)
    return pool.raw.copy()


def _tensors_over(pool, raw: np.ndarray) -> list:
    """The pool's tensors, re-created over another byte array of the same size."""
    base = pool.raw.ctypes.data
    return [raw[t.ctypes.data - base:t.ctypes.data - base + t.nbytes].view(t.dtype).reshape(t.shape)
            for t in pool.tensors]


def expect_after_load(pool, spec: dict, before: np.ndarray, writes) -> np.ndarray:
    """``before`` with ``rows`` written to ``pages`` for every (pages, rows) in ``writes``."""
    exp = before.copy()
    tensors = _tensors_over(pool, exp)
    ps = spec["page_size"]
    for pages, rows in writes:
        for t in range(rows.shape[0]):
            for layer in range(spec["layers"]):
                for plane in range(planes(spec)):
                    row = token_row(spec["layout"], tensors, layer, plane, int(pages[t // ps]),
                                    t % ps, ps)
                    row[...] = rows[t, layer, plane].reshape(row.shape)
    return exp


def assert_rows(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Per token row: [token, layer, plane, bytes] arrays must be equal."""
    bad = np.argwhere((got != want).any(axis=-1))
    assert bad.size == 0, (f"{what}: {len(bad)} token rows differ from the storer's bytes, first "
                           f"(token, layer, plane) = {tuple(int(x) for x in bad[0])}")


def assert_pool(pool, exp: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(pool.raw != exp)
    assert bad.size == 0, (f"{what}: {bad.size} of {exp.size} pool bytes differ from the reference "
                           f"(first at byte {bad[0]})")


def client(runtime_dir: str) -> kvd_client.KvdClient:
    return kvd_client.KvdClient(runtime_dir=runtime_dir, timeout=20, raise_errors=True).connect()


def daemon_stats(runtime_dir: str) -> dict:
    ch = Channel(control_endpoint(Path(runtime_dir)), 5.0)
    try:
        return ch.request("stats")
    finally:
        ch.close()


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

def store_one(runtime_dir: str, spec: dict, seed: int, tokens, model: str, salt=None) -> int:
    pool = make_pool(spec, seed)
    try:
        with client(runtime_dir) as c:
            c.register_kv(pool, model=model)
            n = len(tokens) // CHUNK
            return c.store(tokens, store_pages(spec, seed, n * ppc(spec)), salt=salt)
    finally:
        pool.close()


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


# ---- 5. eviction under memory pressure ---------------------------------------------

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
