"""The remote tier against real stores on loopback: Valkey/Redis and Mooncake Store.

Each test starts the store itself (tests/remote_servers.py: a real
``redis-server``/``valkey-server``, or a real ``mooncake_master`` with the
TCP transport; skipped with the reason when the binary is missing) and real
``kvd serve`` daemons in their own runtime dirs, as two or three nodes of
one cluster; engines run in spawned processes and check every loaded byte
against the storer's seed (tests/workers_disk.py). No part of the store is
mocked. Covered: node A stores, node B hits with exact bytes and another
cluster's prefix sees nothing; a half-local, half-remote load through the
overlapped path, byte exact, cut short where a value fails; a corrupted value is dropped, counted and
deleted; a frozen (Redis) or killed store makes kvd local-only within its
timeout (the breaker opens), and the breaker closes again when the store is
back, after which sharing works again.
"""

from __future__ import annotations

import re
import time

import pytest
import workers_disk as D
import workers_remote as R
from remote_servers import SERVERS, RedisServer, free_port, remote_knobs, running

from kvd.cli.format import format_stats
from kvd.tiers.disk import chunk_file as F

CHUNK = D.CHUNK
SPEC = {"layout": "vllm_flash_attn", "layers": 2, "page_size": 16, "dtype": "float16",
        "heads": 2, "dim": 64, "num_pages": 65}
SHARD = 2 * 2 * CHUNK * 2 * 64 * 2  # 16 KiB
PREFIX = "kvd-test"
TIMEOUT_S = 0.2


@pytest.fixture(params=sorted(SERVERS))
def store(request):
    """The store; tests name it before ``start_daemon`` so their daemons stop before it does."""
    yield from running(request.param)


def node(start_daemon, store, prefix: str = PREFIX, **extra):
    """A kvd daemon of the cluster on ``store`` (connected: its breaker closed)."""
    knobs, env = remote_knobs(store, **{"remote_prefix": prefix, "remote_timeout_s": TIMEOUT_S,
                                        "remote_breaker_retry_s": 0.2, **extra})
    d = start_daemon(env=env, **knobs)
    wait_remote(d, lambda r: r["breaker"] == "closed", "the store to answer")
    return d


def remote(d) -> dict:
    return d.stats()["tiers"]["remote"]


def wait_remote(d, ok, what: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = remote(d)
        if ok(r):
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}: {r}\n{d.log()[-3000:]}")
        time.sleep(0.02)


def test_node_b_hits_what_node_a_stored_with_exact_bytes(store, start_daemon, procs):
    a, b = node(start_daemon, store), node(start_daemon, store)
    other = node(start_daemon, store, prefix="other-cluster")
    count, chunks, model = 3, 4, f"remote/share/{store.backend}"
    assert procs.apply(D.store_seqs, (str(a.runtime_dir), SPEC, 61, count, chunks, model,
                                      False)) == count * chunks * CHUNK
    sent = wait_remote(a, lambda r: r["puts"] == count * chunks, "node A's puts")
    # each value: the chunk header's fields, then the shard (kvd/tiers/disk/chunk_file.py)
    assert sent["put_bytes"] == count * chunks * (F.HEADER.size + SHARD), sent
    assert sent["puts_failed"] == 0
    got = procs.apply(D.load_seqs, (str(b.runtime_dir), SPEC, 61, count, chunks, model))
    assert got == [(chunks * CHUNK, chunks * CHUNK)] * count  # bytes checked in the worker
    st = b.stats()
    r = st["tiers"]["remote"]
    assert st["remote_hits"] == count * chunks and st["misses"] == 0
    assert r["promotions"] == count * chunks and r["gets"] == count * chunks
    assert r["corrupt"] == 0 and r["errors"] == 0 and r["timeouts"] == 0
    # another cluster on the same store sees none of it
    got = procs.apply(D.load_seqs, (str(other.runtime_dir), SPEC, 61, count, chunks, model))
    assert got == [(0, 0)] * count
    assert other.stats()["remote_hits"] == 0
    # what B holds now is not sent again
    assert remote(b)["puts"] == 0


def test_a_half_local_half_remote_load_copies_each_part_with_exact_bytes(store, start_daemon,
                                                                          procs):
    """Node B holds the first half of each prefix and loads it all without a lookup first:
    the load finds the remote half, copies the local half at once and each remote run as it
    lands (``load_pieces``), every byte the storer's; a value that fails mid-load (the fifth
    chunk) gives a shorter load, no error, and the pages after it keep their poison."""
    b, model, pieces = half_local(start_daemon, store, procs, 65, "half")
    count, chunks = HALF_SEQS
    before = calls(store)
    got = procs.apply(D.load_seqs, (str(b.runtime_dir), SPEC, 65, count, chunks, model, False))
    assert got == [(None, chunks * CHUNK)] * (count - 1) + [(None, 4 * CHUNK)]
    r = remote(b)
    # a piece per run of remote chunks whose fetches landed together (they land in any
    # order): one to three (the remote half) per load, one for the damaged load's last
    assert pieces + count <= r["load_pieces"] <= pieces + (count - 1) * (chunks // 2) + 1, r
    assert r["corrupt"] == 1
    assert r["errors"] == 0 and r["timeouts"] == 0
    assert b.stats()["tiers"]["remote"]["promotions"] == count * chunks - 1
    if store.backend == "redis":  # zero-copy, the damaged one too (MGET: the bytes path)
        after = calls(store)
        assert after["mget"] == before["mget"] and r["zero_copy_gets"] == count * chunks


HALF_SEQS = (3, 6)  # sequences, chunks each


def half_local(start_daemon, store, procs, seed: int, tag: str, **extra) -> tuple:
    """Two nodes on ``store`` (more knobs: ``extra``): A stores HALF_SEQS sequences (every value put), B holds the first
    half of each (loaded once from the store); then the last sequence's fifth value is
    corrupted. Returns (B, the model, B's ``load_pieces`` so far)."""
    a, b = node(start_daemon, store, **extra), node(start_daemon, store, **extra)
    ra, rb, model = str(a.runtime_dir), str(b.runtime_dir), f"remote/{tag}/{store.backend}"
    (count, chunks), local = HALF_SEQS, HALF_SEQS[1] // 2
    names = procs.apply(R.store_names, (ra, SPEC, seed, count, chunks, model, PREFIX))
    assert procs.apply(D.store_seqs, (ra, SPEC, seed, count, chunks, model, False)) \
        == count * chunks * CHUNK
    wait_remote(a, lambda r: r["puts"] == count * chunks, "node A's puts")
    assert procs.apply(R.load_prefix, (rb, SPEC, seed, count, chunks, local, model)) \
        == [(local * CHUNK, local * CHUNK)] * count
    pieces = remote(b)["load_pieces"]
    corrupt(store, [names[chunks * (count - 1) + 4]])  # the last sequence's fifth chunk
    return b, model, pieces


def calls(store) -> dict:
    """Redis GET and MGET calls so far (INFO commandstats); zeros for Mooncake."""
    if store.backend != "redis":
        return {"get": 0, "mget": 0}
    client = store.client()
    stats = client.info("commandstats")
    client.close()
    return {c: stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("get", "mget")}


def corrupt(store, names: list) -> None:
    """Flip one payload byte of each value, through the store's own client."""
    if store.backend == "redis":
        client = store.client()
        for name in names:
            value = client.get(name)
            client.setrange(name, len(value) - 1, bytes([value[-1] ^ 0x40]))
        client.close()
        return
    from mooncake.store import MooncakeDistributedStore
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", store.metadata, 0, 16 << 20, "tcp", "", store.address) == 0
    for name in names:
        value = bytearray(client.get(name))
        value[-1] ^= 0x40
        assert client.remove(name, True) == 0 and client.put(name, bytes(value)) == 0
    client.close()


def present(store, names: list) -> list:
    if store.backend == "redis":
        client = store.client()
        try:
            return [bool(client.exists(n)) for n in names]
        finally:
            client.close()
    return [True] * len(names)  # Mooncake: a second client here would race the master's leases


def test_a_corrupted_value_is_dropped_counted_and_deleted(store, start_daemon, procs):
    a, b = node(start_daemon, store), node(start_daemon, store)
    model = f"remote/corrupt/{store.backend}"
    names = procs.apply(R.store_names, (str(a.runtime_dir), SPEC, 71, 1, 2, model, PREFIX))
    assert procs.apply(D.store_seqs, (str(a.runtime_dir), SPEC, 71, 1, 2, model, False)) == 2 * CHUNK
    wait_remote(a, lambda r: r["puts"] == 2, "node A's puts")
    corrupt(store, names)
    got = procs.apply(D.load_seqs, (str(b.runtime_dir), SPEC, 71, 1, 2, model))
    assert got == [(2 * CHUNK, 0)]  # the store said yes; verification said no: nothing loaded
    r = wait_remote(b, lambda r: r["corrupt"] == 2, "both values counted corrupt")
    assert r["promotions"] == 0 and r["promotions_failed"] >= 2
    if store.backend == "redis":  # deleted from the store: a later lookup misses at once
        deadline = time.monotonic() + 10
        while any(present(store, names)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert present(store, names) == [False, False]
        got = procs.apply(D.load_seqs, (str(b.runtime_dir), SPEC, 71, 1, 2, model))
        assert got == [(0, 0)]
    assert b.stats()["tiers"]["host"]["chunks"] == 0  # nothing of it reached the host tier


def lookups_while_away(procs, d, seed: int, model: str) -> list:
    """Lookups of chunks no tier has, while the store is away: each one answered (a miss)
    within a few timeouts, never after the client's own 20 s."""
    timed = procs.apply(R.timed_lookups, (str(d.runtime_dir), SPEC, seed, 8, 2, model))
    assert [hit for hit, _ in timed] == [0] * 8
    assert max(s for _, s in timed) < 10 * TIMEOUT_S + 1.0, timed
    return timed


def test_a_dead_store_makes_kvd_local_only_and_the_breaker_recovers(store, start_daemon, procs):
    a, b = node(start_daemon, store), node(start_daemon, store)
    ra, rb, model = str(a.runtime_dir), str(b.runtime_dir), f"remote/dead/{store.backend}"
    if store.backend == "redis":  # frozen: connections hang, calls time out
        store.freeze()
        lookups_while_away(procs, b, 80, model)
        r = wait_remote(b, lambda r: r["breaker"] != "closed", "the breaker to open")
        assert r["timeouts"] + r["errors"] >= 3 and r["breaker_opened"] == 1
        store.thaw()
        wait_remote(b, lambda r: r["breaker"] == "closed", "the breaker to close after a thaw")
    store.kill()
    # node A goes on storing (local only), node B on looking up: both answer at once
    assert procs.apply(D.store_seqs, (ra, SPEC, 81, 2, 2, model, False)) == 4 * CHUNK
    lookups_while_away(procs, b, 82, model)
    r = wait_remote(b, lambda r: r["breaker"] != "closed", "the breaker to open")
    assert r["errors"] + r["timeouts"] >= 3 and r["skipped"] >= 1
    assert remote(a)["puts"] == 0
    assert procs.apply(D.load_seqs, (ra, SPEC, 81, 2, 2, model)) == [(2 * CHUNK, 2 * CHUNK)] * 2
    # back: both breakers close; what A stores now reaches B
    store.start()
    for d in (a, b):
        wait_remote(d, lambda r: r["breaker"] == "closed", "the breaker to close")
    assert procs.apply(D.store_seqs, (ra, SPEC, 83, 2, 2, model, False)) == 4 * CHUNK
    wait_remote(a, lambda r: r["puts"] == 4, "node A's puts after the store came back")
    assert procs.apply(D.load_seqs, (rb, SPEC, 83, 2, 2, model)) == [(2 * CHUNK, 2 * CHUNK)] * 2
    for d in (a, b):
        assert d.stop() == 0


def scrape(port: int) -> str:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def test_down_at_start_then_cold_chunks_follow_the_disk_demoter(start_daemon, procs, tmp_path):
    """kvd serves with its store down from the start; ``remote_publish = demote`` sends what
    the disk demoter takes once the store is up; ``kvd stats`` and /metrics show it."""
    why = RedisServer.missing()
    if why:
        pytest.skip(why)
    server = RedisServer()  # its port is chosen, nothing listens yet
    server.backend = "redis"
    port, model = free_port(), "remote/demote"
    try:
        a = start_daemon(remote_backend="redis", remote_address=server.url, remote_prefix=PREFIX,
                         remote_timeout_s=TIMEOUT_S, remote_breaker_retry_s=0.2,
                         remote_publish="demote", disk_dir=str(tmp_path / "disk"),
                         host_capacity="256KiB", disk_high_watermark=0.1, metrics_port=port)
        ra = str(a.runtime_dir)
        assert procs.apply(D.store_seqs, (ra, SPEC, 91, 2, 2, model, False)) == 4 * CHUNK
        r = wait_remote(a, lambda r: r["publish_skipped"] >= 1 and r["probe_failures"] >= 1,
                        "demotions skipped and a probe failed while down")
        assert r["breaker"] != "closed" and r["puts"] == 0
        text = format_stats(a.stats())
        assert "remote: redis " + server.url in text and "breaker " in text
        server.start()
        wait_remote(a, lambda r: r["breaker"] == "closed", "the store to answer")
        assert procs.apply(D.store_seqs, (ra, SPEC, 92, 2, 2, model, False)) == 4 * CHUNK
        wait_remote(a, lambda r: r["puts"] == 4, "the demoted chunks' puts")
        b = node(start_daemon, server)
        got = procs.apply(D.load_seqs, (str(b.runtime_dir), SPEC, 92, 2, 2, model))
        assert got == [(2 * CHUNK, 2 * CHUNK)] * 2
        metrics = scrape(port)
        puts = re.search(r"^kvd_remote_puts_total (\S+)$", metrics, re.M)
        assert puts and float(puts.group(1)) == remote(a)["puts"] >= 4
        assert 'kvd_remote_breaker_state{state="closed"} 1.0' in metrics
        assert 'kvd_remote_failures_total{kind="error"}' in metrics
        assert a.stop() == 0 and b.stop() == 0
    finally:
        server.stop()
