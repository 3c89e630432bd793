"""The data path end to end: a real ``kvd serve``, real engine processes.

Engine halves run in spawned client processes (tests/workers_data_sharing.py,
tests/workers_data_eviction.py); the bytes they expect are computed there
from the engines' own tensor indexing and the storers' seeds
(tests/workers_data.py), never by kvd's copy code. Covered: every layout x
page size x dtype across processes, layouts sharing one namespace, prefix
semantics, dedup across clients, namespace and salt isolation, eviction
under memory pressure (LRU, pinning), tensor parallel shards and the MLA
latent, leases, and ``kvd bench``.
"""

from __future__ import annotations

import itertools
import multiprocessing
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import workers_data as W
import workers_data_eviction as E
import workers_data_sharing as S

from kvd_protocol.layout import LAYOUTS

CHUNK = W.CHUNK
DTYPES = ("float16", "bfloat16", "float8_e4m3fn")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
MHA = {"heads": 2, "dim": 12}   # rows of 48 B (16-bit) and 24 B (fp8)
MLA = {"heads": 1, "dim": 36}   # latent rows of 72 B and 36 B: not multiples of 16
RUN_S = 120


@pytest.fixture(scope="module")
def manager():
    """Barriers shared by pool workers (plain multiprocessing ones cannot be passed)."""
    with multiprocessing.get_context("spawn").Manager() as m:
        yield m


def run_all(procs, fn, arg_lists: list, timeout: float = RUN_S) -> list:
    """Run ``fn(*args)`` for every args at once; raise the root failure, not a broken barrier."""
    jobs = [procs.apply_async(fn, args) for args in arg_lists]
    results, errors = [], []
    for job in jobs:
        try:
            results.append(job.get(timeout))
        except threading.BrokenBarrierError as exc:
            errors.append(exc)
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.insert(0, exc)
    if errors:
        raise errors[0]
    return results


def spec(layout: str, page_size: int = 16, dtype: str = "float16", layers: int = 2,
         num_pages: int | None = None, **geo) -> dict:
    geo = geo or (MLA if layout.endswith("mla") else MHA)
    ppc = CHUNK // page_size
    return {"layout": layout, "layers": layers, "page_size": page_size, "dtype": dtype,
            "num_pages": num_pages or 7 * ppc + 1, **geo}


def shard_bytes(s: dict) -> int:
    return s["layers"] * W.planes(s) * CHUNK * s["heads"] * s["dim"] * DTYPE_BYTES[s["dtype"]]


def host(daemon) -> dict:
    return daemon.stats()["tiers"]["host"]


# ---- 1. every layout x page size x dtype ---------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_page_size_dtype_roundtrips_across_processes(daemon, procs, manager, layout):
    """4 engines of one model store their own sequences; each loads another's, bit-exact,
    into random other pages, and nothing else of its pool changes."""
    rounds = []
    for i, (ps, dtype) in enumerate(itertools.product((1, 4, 16), DTYPES)):
        s = spec(layout, ps, dtype)
        rounds.append({"specs": [s] * 4, "seed": 1000 * LAYOUTS.index(layout) + i + 1,
                       "model": f"rt/{layout}/{ps}/{dtype}"})
    barrier = manager.Barrier(4)
    checked = run_all(procs, S.roundtrip, [(str(daemon.runtime_dir), i, rounds, barrier)
                                           for i in range(4)])
    whole = sum(n // CHUNK for n in S.SEQ_LENGTHS)
    assert checked == [len(rounds) * whole * CHUNK] * 4
    st = daemon.stats()
    assert st["chunks_stored"] == 4 * whole * len(rounds)
    assert st["chunks_loaded"] == 4 * whole * len(rounds)
    assert st["store_dedup"] == 0 and st["errors"] == 0
    assert st["tiers"]["host"]["chunks"] == 4 * whole * len(rounds)


def test_layouts_of_one_namespace_share_chunks(daemon, procs, manager):
    """Engines with different GPU layouts and page sizes of the same model share chunks:
    process i stores in its layout, process i+1 loads into another layout (vLLM's GPU
    blocks, head-strided rows, among them)."""
    mha = [spec("vllm_flash_attn", 16, "bfloat16"), spec("vllm_flashinfer", 4, "bfloat16"),
           spec("sglang_mha", 1, "bfloat16"), spec("page_first", 8, "bfloat16")]
    mla = [spec("vllm_mla", 16, "float8_e4m3fn"), spec("sglang_mla", 1, "float8_e4m3fn"),
           spec("vllm_mla", 2, "float8_e4m3fn"), spec("sglang_mla", 8, "float8_e4m3fn")]
    blocks = [spec("vllm_kv_blocks", 16, "bfloat16"), spec("sglang_mha", 1, "bfloat16"),
              spec("vllm_kv_blocks", 2, "bfloat16"), spec("vllm_flash_attn", 4, "bfloat16")]
    rounds = [{"specs": mha, "seed": 9001, "model": "shared/mha"},
              {"specs": mla, "seed": 9002, "model": "shared/mla"},
              {"specs": blocks, "seed": 9003, "model": "shared/vllm-gpu-blocks"}]
    barrier = manager.Barrier(4)
    checked = run_all(procs, S.roundtrip, [(str(daemon.runtime_dir), i, rounds, barrier)
                                           for i in range(4)])
    assert all(c > 0 for c in checked)
    st = daemon.stats()
    assert st["store_dedup"] == 0 and st["errors"] == 0


# ---- 2. prefix semantics ------------------------------------------------------------

def test_changed_token_limits_lookup_and_load_to_the_prefix(daemon, procs):
    s = spec("vllm_flash_attn", 4, "float16")
    tokens = W.seq_tokens(77, [4 * CHUNK + 5])[0]
    rd = str(daemon.runtime_dir)
    assert procs.apply(W.store_one, (rd, s, 77, tokens, "prefix")) == 4 * CHUNK
    # token position changed -> chunks that still match (None: unchanged)
    changes = {None: 4, 0: 0, CHUNK + 1: 1, 2 * CHUNK + 3: 2, 4 * CHUNK - 1: 3, 4 * CHUNK + 2: 4}
    seen = procs.apply(S.prefix_probe, (rd, s, 77, tokens, "prefix", list(changes)))
    for pos, k in changes.items():
        assert seen[pos] == (k * CHUNK, k * CHUNK), f"token {pos} changed: {seen[pos]}"


# ---- 3. dedup across clients --------------------------------------------------------

def test_dedup_across_clients(daemon, procs, manager):
    s = spec("vllm_flash_attn", 4, "float16", heads=2, dim=16)
    shard = shard_bytes(s)
    assert shard % 4096 == 0  # so used_bytes is exact whatever the allocator's alignment
    rd = str(daemon.runtime_dir)
    # one after the other: the second client's store is all dedup, its bytes never copied
    tokens = W.seq_tokens(5, [3 * CHUNK])[0]
    assert procs.apply(W.store_one, (rd, s, 11, tokens, "dedup")) == 3 * CHUNK
    assert procs.apply(W.store_one, (rd, s, 12, tokens, "dedup")) == 3 * CHUNK
    st = daemon.stats()
    assert st["store_dedup"] == 3 and st["chunks_stored"] == 3
    assert st["tiers"]["host"]["chunks"] == 3 and st["tiers"]["host"]["entries"] == 3
    assert st["tiers"]["host"]["used_bytes"] == 3 * shard
    owners = procs.apply(S.load_check, (rd, s, 13, tokens, "dedup", [11, 12]))
    assert owners == [11, 11, 11]  # the first writer's bytes; the duplicate was not copied

    # four clients storing the same chunks at the same moment: one copy of each
    tokens = W.seq_tokens(6, [2 * CHUNK + 7])[0]
    barrier = manager.Barrier(4)
    seeds = [21, 22, 23, 24]
    got = run_all(procs, S.store_in_step, [(rd, s, sd, tokens, "dedup", barrier) for sd in seeds])
    assert got == [2 * CHUNK] * 4
    st = daemon.stats()
    assert st["chunks_stored"] == 3 + 2 and st["store_dedup"] == 3 + 3 * 2
    assert st["tiers"]["host"]["chunks"] == 5 and st["tiers"]["host"]["used_bytes"] == 5 * shard
    owners = procs.apply(S.load_check, (rd, s, 25, tokens, "dedup", seeds))
    assert all(o in seeds for o in owners), owners

    # a longer sequence over a cached prefix: the prefix is dedup, only the new chunks
    # are copied, each from its own pages
    longer = np.concatenate([W.seq_tokens(5, [3 * CHUNK])[0], W.seq_tokens(7, [2 * CHUNK])[0]])
    assert procs.apply(W.store_one, (rd, s, 14, longer, "dedup")) == 5 * CHUNK
    st = daemon.stats()
    assert st["chunks_stored"] == 5 + 2 and st["store_dedup"] == 9 + 3
    assert st["tiers"]["host"]["used_bytes"] == 7 * shard
    owners = procs.apply(S.load_check, (rd, s, 15, longer, "dedup", [11, 12, 14]))
    assert owners == [11, 11, 11, 14, 14]


# ---- 4. namespace and salt isolation ----------------------------------------------

def test_namespace_and_salt_isolation(daemon, procs):
    base = {**spec("vllm_flash_attn", 16, "float16"), "model": "iso/model"}
    rd = str(daemon.runtime_dir)
    plain, salted = W.seq_tokens(40, [2 * CHUNK, 2 * CHUNK])
    assert procs.apply(W.store_one, (rd, base, 41, plain, "iso/model")) == 2 * CHUNK
    assert procs.apply(W.store_one, (rd, base, 42, salted, "iso/model", "tenant-a")) == 2 * CHUNK
    hit, miss = (2 * CHUNK, 2 * CHUNK), (0, 0)
    plain_variants = {
        "same": ({}, hit),
        "other layout, same namespace": ({"layout": "vllm_flashinfer", "page_size": 4}, hit),
        "model": ({"model": "iso/other"}, miss),
        "dtype": ({"dtype": "bfloat16"}, miss),
        "kv heads": ({"heads": 4}, miss),
        "head dim": ({"dim": 16}, miss),
        "layers": ({"layers": 3}, miss),
        "tp size": ({"tp_size": 2}, miss),
        # the next pipeline stage of a model with these layers twice: equal layer counts
        "pipeline stage": ({"first_layer": base["layers"]}, miss),
        "fingerprint": ({"fingerprint": "ckpt:1f2e+lora:sql"}, miss),
        "empty fingerprint": ({"fingerprint": ""}, hit),
        "salt": ({"salt": "tenant-a"}, miss),
    }
    seen = procs.apply(S.isolation_probe, (rd, base, plain, {k: v for k, (v, _) in plain_variants.items()}))
    assert seen == {k: want for k, (_, want) in plain_variants.items()}
    salted_variants = {
        "no salt": ({}, miss),
        "same salt": ({"salt": "tenant-a"}, hit),
        "other salt": ({"salt": "tenant-b"}, miss),
        "same salt, other model": ({"salt": "tenant-a", "model": "iso/other"}, miss),
    }
    seen = procs.apply(S.isolation_probe, (rd, base, salted, {k: v for k, (v, _) in salted_variants.items()}))
    assert seen == {k: want for k, (_, want) in salted_variants.items()}


# ---- 5. eviction under memory pressure ------------------------------------------

# rows of 30 B: a shard of 1920 B, not a multiple of any alignment the allocator may use
EVICT_SPEC = spec("vllm_flash_attn", 4, "float16", heads=3, dim=5, num_pages=64)
EVICT_N = 4


def _evict_capacity() -> int:
    shard = shard_bytes(EVICT_SPEC)
    return EVICT_N * shard + shard // 2  # room for N chunks (aligned to 256 or not), not N+1


def test_eviction_keeps_memory_bounded_and_the_newest_chunks(start_daemon, procs):
    d = start_daemon(host_capacity=_evict_capacity())
    rd, n = str(d.runtime_dir), EVICT_N
    res = procs.apply(E.eviction_store, (rd, EVICT_SPEC, 51, 3 * n, n))
    for i, h in enumerate(res["trace"]):
        assert h["used_bytes"] <= h["capacity_bytes"] <= _evict_capacity(), (i, h)
        assert h["chunks"] == min(i + 1, n), (i, h)
        assert h["entries"] == min(i + 1, n), (i, h)
    assert res["trace"][-1]["evictions"] == 2 * n
    # LRU: with the tier full, a lookup of sequence 0 made it recent; sequence 1 went instead
    assert res["lru"] == {"seq0_before": CHUNK, "seq0_after": CHUNK, "seq1_after": 0}
    hits = procs.apply(E.eviction_check, (rd, EVICT_SPEC, 51, 3 * n))
    assert hits == [0] * (2 * n) + [CHUNK] * n
    st = d.stats()
    assert st["tiers"]["host"]["evictions"] == 2 * n
    assert st["tiers"]["host"]["used_bytes"] <= st["tiers"]["host"]["capacity_bytes"]
    assert st["chunks_loaded"] == n


def test_pinned_chunks_are_never_evicted(start_daemon, procs):
    d = start_daemon(host_capacity=_evict_capacity())
    n = EVICT_N
    res = procs.apply(E.pinned_pressure, (str(d.runtime_dir), EVICT_SPEC, 61, n))
    assert res["full_store"] == "no_space"
    assert res["host_after"] == res["host_before"]
    assert res["host_before"]["chunks"] == n and res["host_before"]["evictions"] == 0
    assert res["hits_while_pinned"] == [CHUNK] * n
    assert res["store_after_release"] == CHUNK
    assert res["hits_after"] == [0] + [CHUNK] * n
    assert res["leases_left"] == 0
    h = host(d)
    assert h["used_bytes"] <= h["capacity_bytes"] and h["evictions"] == 1


def test_lookup_and_load_stop_at_an_evicted_middle_chunk(start_daemon, procs):
    """Chunks after a hole in the chain are never used, even though they are still cached."""
    d = start_daemon(host_capacity=_evict_capacity())
    rd, s = str(d.runtime_dir), EVICT_SPEC
    chain, *fillers = W.seq_tokens(33, [3 * CHUNK] + [CHUNK] * (EVICT_N - 3 + 1))
    seen = procs.apply(E.evict_middle_chunk, (rd, s, 33, chain, fillers, "hole"))
    # the chain hits; once the tier is full chunk 0 is touched and the next store evicts chunk 1
    assert seen == [3 * CHUNK, CHUNK, CHUNK], seen
    assert host(d)["chunks"] == EVICT_N and host(d)["evictions"] == 1
    # another process: lookup and load give chunk 0 only; chunk 2 is cached but unreachable
    assert procs.apply(S.prefix_probe, (rd, s, 33, chain, "hole", [None])) == {None: (CHUNK, CHUNK)}


# ---- 6. tensor parallel ---------------------------------------------------------

def test_tensor_parallel_ranks_store_and_load_their_own_shards(daemon, procs, manager):
    s = spec("vllm_flash_attn", 4, "float16", heads=2, dim=16)
    tokens = W.seq_tokens(70, [2 * CHUNK + 3])[0]
    barrier = manager.Barrier(2)
    seeds = [71, 72]
    r0, r1 = run_all(procs, S.tp_rank_flow, [(str(daemon.runtime_dir), s, rank, seeds, tokens, barrier)
                                              for rank in (0, 1)])
    full = 2 * CHUNK
    for rank, r in enumerate((r0, r1)):
        assert r["store"] == full
        assert r["lookup_one_stored"] == 0, f"rank {rank} hit an entry with one shard of two"
        assert r["load_one_stored"] == 0
        assert r["lookup_all_stored"] == full and r["load_all_stored"] == full
        assert r["own_shard"] and not r["other_shard"], f"rank {rank} got the wrong shard"
    st = daemon.stats()
    assert st["tiers"]["host"]["chunks"] == 2 and st["tiers"]["host"]["entries"] == 2
    assert st["tiers"]["host"]["used_bytes"] == 2 * 2 * shard_bytes(s)
    assert st["chunks_stored"] == 4 and st["store_dedup"] == 0


def test_tensor_parallel_mla_latent_is_stored_once(daemon, procs, manager):
    s = spec("vllm_mla", 16, "float8_e4m3fn")
    tokens = W.seq_tokens(80, [2 * CHUNK])[0]
    barrier = manager.Barrier(2)
    r0, r1 = run_all(procs, S.tp_rank_flow, [(str(daemon.runtime_dir), s, rank, [81, 82], tokens, barrier)
                                              for rank in (0, 1)])
    full = 2 * CHUNK
    assert r0["store"] == full and r1["store"] == full  # rank 1's store is pure dedup
    for r in (r0, r1):
        assert r["lookup_one_stored"] == full and r["load_one_stored"] == full
        assert r["lookup_all_stored"] == full and r["own_shard"]
    assert r1["lookup_tp1"] == full
    st = daemon.stats()
    assert st["chunks_stored"] == 2 and st["store_dedup"] == 2
    assert st["tiers"]["host"]["chunks"] == 2
    assert st["tiers"]["host"]["used_bytes"] < 2 * 2 * shard_bytes(s)


# ---- 7. leases --------------------------------------------------------------------

def test_lease_is_consumed_by_the_load(daemon, procs):
    out = procs.apply(E.lease_flow, (str(daemon.runtime_dir), spec("sglang_mha", 4, "bfloat16"), 90))
    assert out["hit"] == 3 * CHUNK and out["lease"] is not None
    assert out["leases_held"] == 1
    assert out["load"] == 3 * CHUNK and out["leases_after_load"] == 0
    assert out["second_load"] == "not_found"
    assert out["release_consumed"] == "not_found"
    assert out["expired_load"] == "not_found" and out["leases_end"] == 0
    assert out["quiet_second_load"] == 0


# ---- 8. kvd bench ---------------------------------------------------------------

def test_bench_prints_the_throughput_table():
    cmd = [sys.executable, "-m", "kvd", "bench", "--layers", "2", "--kv-heads", "2", "--head-dim", "64",
           "--chunks", "4", "--repeat", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^what\s+median ms\s+GB/s\s+vs numpy copy$", out, re.M), out
    for name in ("store", "load", "numpy copy"):
        assert re.search(rf"^{name}\s+\d+\.\d+\s+\d+\.\d+\s+\d+%$", out, re.M), f"no {name} row:\n{out}"
    assert len(re.findall(r"^  run \d", out, re.M)) == 3, out  # warm-up + 2 timed runs
