"""Failure model, clients: dead clients are reaped, idle ones are not; leases under pressure.

kvd is a cache: it may lose entries but never takes an engine down. A client
that dies is reaped after ``client_timeout_s`` (leases and mappings
released, the shared-memory files it left removed); a live idle client is
not. Leased hits survive memory pressure; with everything leased a store
gets ``no_space``; released or expired leases make eviction possible again.
The daemon's side (restarts, crashes, bad config): test_failures_daemon.py.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import workers_failures as W
from daemons import wait_for
from workers_failures import random_pool, same_pages

import kvd_client


def mapped(pid: int, needle: str) -> bool:
    return needle in Path(f"/proc/{pid}/maps").read_text()


# ---- (a) a client killed mid-flight is reaped -------------------------------------

def test_killed_client_is_reaped_and_its_leases_released(daemon, procs):
    rd = str(daemon.runtime_dir)
    timeout_s = daemon.knobs["client_timeout_s"]
    ctx = multiprocessing.get_context("spawn")
    report, child_end = ctx.Pipe(duplex=False)
    stores_started = ctx.Value("i", 0)
    victim = ctx.Process(target=W.victim, args=(rd, child_end, stores_started), daemon=True)
    victim.start()
    child_end.close()
    observer = kvd_client.KvdClient(runtime_dir=rd, raise_errors=True).connect()
    pool = random_pool(11, "vllm_flash_attn", 4, 32, 16, 8, 64, "float16")  # the victim's namespace
    info = None
    try:
        assert report.poll(30), "victim did not start"
        info = report.recv()
        assert info["hits"] == len(W.LEASED_TOKENS) and info["lease"] is not None
        observer.register_kv(pool, model=W.VICTIM_MODEL)
        assert observer.lookup(W.LEASED_TOKENS) == len(W.LEASED_TOKENS)
        wait_for(lambda: stores_started.value >= 2, 30, "the victim's stores")
        before = daemon.stats()
        assert before["clients"] == 2 and before["leases"] == 1 and before["registrations"] == 2
        assert mapped(daemon.proc.pid, info["pool"])
        # Kill it just after it starts a 24 MiB store: most likely while the daemon copies.
        started = stores_started.value
        wait_for(lambda: stores_started.value > started, 30, "the next store", interval=0.001)
        time.sleep(0.005)
        os.kill(info["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        victim.join(10)
        assert victim.exitcode == -signal.SIGKILL
        # Another engine works while the dead one is still registered.
        assert procs.apply(W.roundtrip, (rd, 5)) is True
        stats = wait_for(lambda: (s := daemon.stats())["clients"] == 1 and s, timeout_s + 5,
                         "the dead client to be reaped")
        reaped_after = time.monotonic() - killed_at
        # its connection closed: the daemon's probe finds it gone, no need to wait the timeout
        assert reaped_after < timeout_s, f"reaped {reaped_after:.2f} s after death"
        assert "removed: connection closed" in daemon.log()
        assert stats["clients_reaped"] >= 1
        assert stats["leases"] == 0 and stats["registrations"] == 1
        host = stats["tiers"]["host"]
        assert host["entries"] == host["chunks"], "an entry was left half-written"
        assert not mapped(daemon.proc.pid, info["pool"]), "the dead client's pool is still mapped"
        # Its pins are gone: pressure from another client can evict the formerly leased chunks.
        assert observer.lookup(W.LEASED_TOKENS) == len(W.LEASED_TOKENS)
        chunks_per_store = 32
        fills = -(-host["capacity_bytes"] // (chunks_per_store * 128 * 1024)) + 2
        rng = np.random.default_rng(1)
        for _ in range(fills):
            tokens = rng.integers(0, 2**31, chunks_per_store * 16)
            assert observer.store(tokens, np.arange(32)) == len(tokens)
        assert observer.lookup(W.LEASED_TOKENS) == 0
        assert daemon.stats()["tiers"]["host"]["evictions"] > host["evictions"]
        # And everyone else still works.
        assert procs.apply(W.roundtrip, (rd, 6)) is True
    finally:
        if victim.is_alive():
            victim.kill()
        observer.close()
        pool.close()
        if info is not None:  # a killed process leaves its pool and flag files
            Path(info["pool"]).unlink(missing_ok=True)
            for leftover in Path("/dev/shm").glob(f"kvd-flags-{info['pid']}-*"):
                leftover.unlink()


def test_a_killed_clients_shared_memory_files_are_removed_by_the_daemon(daemon):
    """No other client starts meanwhile (a new one would remove dead files too): the daemon
    removes the pool and flag page a SIGKILLed engine left, once it reaped it."""
    ctx = multiprocessing.get_context("spawn")
    report, child_end = ctx.Pipe(duplex=False)
    holder = ctx.Process(target=W.holder, args=(str(daemon.runtime_dir), child_end), daemon=True)
    holder.start()
    child_end.close()
    info = None
    try:
        assert report.poll(30), "the holder did not start"
        info = report.recv()
        flags = list(Path("/dev/shm").glob(f"kvd-flags-{info['pid']}-*"))
        assert Path(info["pool"]).exists() and len(flags) == 1
        os.kill(info["pid"], signal.SIGKILL)
        holder.join(10)
        stats = wait_for(lambda: (s := daemon.stats())["clients_reaped"] >= 1 and s, 20,
                         "the killed client to be reaped")
        assert not Path(info["pool"]).exists() and not flags[0].exists()
        # another test's client starting now removes dead processes' files too (xdist workers
        # share /dev/shm), so who took them is not fixed here; tests/server/test_leftovers.py
        # pins the daemon's own rule
        assert stats["client_files_removed"] <= 2
    finally:
        if holder.is_alive():
            holder.kill()
        if info is not None:  # where the daemon did not (the test failed)
            Path(info["pool"]).unlink(missing_ok=True)
            for leftover in Path("/dev/shm").glob(f"kvd-flags-{info['pid']}-*"):
                leftover.unlink()


# ---- (b) an idle client with heartbeats is not reaped ----------------------------

def test_idle_client_with_heartbeats_is_not_reaped(start_daemon):
    daemon = start_daemon(client_timeout_s=1.0, heartbeat_interval_s=0.2)
    rd = str(daemon.runtime_dir)
    live = kvd_client.KvdClient(runtime_dir=rd, raise_errors=True).connect()
    silent = kvd_client.KvdClient(runtime_dir=rd, raise_errors=True, heartbeat=False).connect()
    pool = random_pool(21)
    try:
        reg = live.register_kv(pool, model="idle")
        silent.register_kv(pool, model="idle")
        tokens = np.arange(64)
        assert live.store(tokens, np.arange(16)) == 64
        hits, lease = live.lookup_lease(tokens, 60_000)
        assert hits == 64
        reg_id = reg.id
        assert daemon.stats()["clients"] == 2
        time.sleep(3.5)  # three and a half timeouts of doing nothing
        stats = daemon.stats()
        assert stats["clients"] == 1 and stats["clients_reaped"] == 1  # only the silent one
        assert stats["registrations"] == 1 and stats["leases"] == 1
        # The live client never had to say hello again: same registration, same lease.
        assert reg.id == reg_id
        assert live.load(tokens, np.arange(16, 32), lease=lease) == 64
        assert same_pages(pool, slice(0, 16), slice(16, 32))
        assert daemon.stats()["clients_reaped"] == 1
    finally:
        live.close()
        silent.close()
        pool.close()


# ---- (c) leases under memory pressure ------------------------------------------------

def test_leases_hold_under_pressure_then_release_and_expire(start_daemon):
    chunk = 2048
    daemon = start_daemon(host_capacity=8 * chunk)  # room for exactly 8 chunks
    rd = str(daemon.runtime_dir)
    a = kvd_client.KvdClient(runtime_dir=rd, raise_errors=True).connect()
    b = kvd_client.KvdClient(runtime_dir=rd, raise_errors=False).connect()
    b_strict = kvd_client.KvdClient(runtime_dir=rd, raise_errors=True).connect()
    pool_a, pool_b = random_pool(51), random_pool(52)
    a1, a2 = np.arange(64), np.arange(64) + 10_000  # 4 chunks each, independent prefixes
    b_tokens = iter(np.arange(64) + 100_000 * i for i in range(1, 100))
    try:
        a.register_kv(pool_a, model="lease")
        b.register_kv(pool_b, model="lease")
        b_strict.register_kv(pool_b, model="lease")
        assert daemon.stats()["tiers"]["host"]["capacity_bytes"] == 8 * chunk
        # A leased hit survives another client's stores, far more than the tier holds.
        assert a.store(a1, np.arange(16)) == 64
        hits, lease1 = a.lookup_lease(a1, 60_000)
        assert hits == 64
        for _ in range(4):
            assert b.store(next(b_tokens), np.arange(16)) == 64
        assert daemon.stats()["tiers"]["host"]["evictions"] >= 8
        assert a.lookup(a1) == 64
        assert a.load(a1, np.arange(16, 32), lease=lease1) == 64
        assert same_pages(pool_a, slice(0, 16), slice(16, 32))
        assert daemon.stats()["leases"] == 0  # a load consumes its lease
        # Everything leased: stores get no_space and nothing cached is touched.
        _, lease1 = a.lookup_lease(a1, 60_000)
        assert a.store(a2, np.arange(16)) == 64
        _, lease2 = a.lookup_lease(a2, 60_000)
        # the journal seals the stored shards once copies have been idle a while
        wait_for(lambda: daemon.stats()["tiers"]["host"]["warm"]["unsealed_shards"] == 0, 10,
                 "the checksums of the stores")
        before = daemon.stats()
        assert before["tiers"]["host"]["entries"] == 8 and before["leases"] == 2
        t = next(b_tokens)
        assert b.store(t, np.arange(16)) == 0
        assert b.store(t[:16], np.arange(4)) == 0
        with pytest.raises(kvd_client.NoSpace):
            b_strict.store(t, np.arange(16))
        after = daemon.stats()
        assert after["errors"] - before["errors"] == 3
        assert after["tiers"]["host"] == before["tiers"]["host"]
        assert a.lookup(a1) == 64 and a.lookup(a2) == 64
        # Released: those entries can be evicted again (the others stay pinned).
        a.release(lease1)
        assert b.store(t, np.arange(16)) == 64
        assert a.lookup(a1) == 0 and a.lookup(a2) == 64
        assert b.store(next(b_tokens), np.arange(16)) == 64
        assert a.lookup(a2) == 64
        # Expired: a short lease alone pins a2; once it lapses a2 can be evicted.
        _, short = a.lookup_lease(a2, 700)
        a.release(lease2)
        assert daemon.stats()["leases"] == 1
        t = next(b_tokens)
        wait_for(lambda: daemon.stats()["leases"] == 0, 5, "the short lease to expire")
        assert b.store(np.concatenate([t, t + 50_000]), np.arange(32)) == 128  # the whole tier
        assert a.lookup(a2) == 0
        with pytest.raises(kvd_client.ServerError) as err:
            a.release(short)
        assert err.value.code == "not_found"
    finally:
        for c in (a, b, b_strict):
            c.close()
        pool_a.close()
        pool_b.close()
