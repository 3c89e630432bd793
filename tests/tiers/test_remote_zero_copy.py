"""The zero-copy path against a real ``mooncake_master`` or Redis server and real daemons.

Mooncake: each daemon registers its host arena with its Mooncake client
(kvd/tiers/remote/mooncake.py) and moves chunks between the arena and the
store with Mooncake's multi-buffer batch calls; Redis: values are sent from
the arena and GET replies read into it (kvd/tiers/remote/redis_arena.py); a run of
chunks a call (kvd/tiers/remote/zero_copy.py);
``kvd stats`` shows it (``zero_copy``, ``zero_copy_puts``, ``zero_copy_gets``)
and its log says so once. Proved here, engines checking every loaded byte
against the storer's seed (tests/workers_disk.py): two daemons share chunks
byte for byte on the zero-copy path; a value damaged in the store (a
payload byte, a header byte, a value of another size) is a miss, counted
once, deleted and never served, and its host slot is freed; a daemon with the path off
(``remote_mooncake_zero_copy = false``, the bytes path a failed
registration also falls back to; ``remote_redis_zero_copy = false``) says why once and shares chunks both ways
with a zero-copy one (the stored values are the same). Skipped, with the
reason, without the Mooncake wheel or ``libibverbs.so.1``, or without a Redis server. A node with checksum processes
(``remote_digest_processes``, kvd/tiers/remote/digest_pool.py) checks through them, catches damage
through them, and they end with it, also when it is killed.
"""

from __future__ import annotations

import os

import pytest
import workers_disk as D
import workers_remote as R
from daemons import wait_for
from remote_servers import running
from test_remote_tier import PREFIX, SPEC, calls, corrupt, remote, wait_remote
from test_remote_tier import node as tier_node

from kvd.cli.format import format_stats

CHUNK = D.CHUNK


def node(start_daemon, store, **extra):
    """A node whose store calls may take 2 s (nothing here tests timeouts, and a loaded
    2-core VM has stalled a 16 KiB put past 0.2 s)."""
    return tier_node(start_daemon, store, remote_timeout_s=2.0, **extra)
NAME = {"mooncake": "Mooncake", "redis": "Redis"}


def on(store) -> str:
    return f"{NAME[store.backend]} zero-copy path on"


def off(store) -> str:
    return f"{NAME[store.backend]} zero-copy path off (remote_{store.backend}_zero_copy = false)"


@pytest.fixture(params=["mooncake", "redis"])
def store(request):
    yield from running(request.param)


def rewrite(store, names: list, change) -> None:
    """Replace each value by ``change(bytearray of it)``, through the store's own client."""
    if store.backend == "redis":
        client = store.client()
        try:
            for name in names:
                client.set(name, bytes(change(bytearray(client.get(name)))))
        finally:
            client.close()
        return
    from mooncake.store import MooncakeDistributedStore
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", store.metadata, 0, 16 << 20, "tcp", "", store.address) == 0
    try:
        for name in names:
            value = change(bytearray(client.get(name)))
            assert client.remove(name, True) == 0 and client.put(name, bytes(value)) == 0
    finally:
        client.close()


def test_two_daemons_share_chunks_byte_exact_on_the_zero_copy_path(store, start_daemon, procs):
    """Node B checks in two checksum processes (kvd/tiers/remote/digest_pool.py), node A in its own
    threads (the default on a machine of fewer than 4 cores)."""
    a = node(start_daemon, store, remote_digest_processes=0)
    b = node(start_daemon, store, remote_digest_processes=2)
    for d in (a, b):
        assert remote(d)["zero_copy"] is True
        assert d.log().count(on(store)) == 1
    count, chunks, model = 3, 4, "remote/zero-copy/share"
    n = count * chunks
    assert procs.apply(D.store_seqs, (str(a.runtime_dir), SPEC, 41, count, chunks, model,
                                      False)) == n * CHUNK
    sent = wait_remote(a, lambda r: r["puts"] == n, "node A's puts")
    assert sent["zero_copy_puts"] == n and sent["puts_failed"] == 0
    got = procs.apply(D.load_seqs, (str(b.runtime_dir), SPEC, 41, count, chunks, model))
    assert got == [(chunks * CHUNK, chunks * CHUNK)] * count  # bytes checked in the worker
    r = remote(b)
    assert r["zero_copy_gets"] == r["gets"] == r["promotions"] == n
    assert r["corrupt"] == 0 and r["errors"] == 0 and r["timeouts"] == 0
    assert r["digest_processes"] == 2 and r["digests_in_processes"] == n
    assert r["digests_in_threads"] == r["digest_processes_lost"] == 0
    assert remote(a)["digest_processes"] == 0  # A's checks ran on its threads
    assert "zero-copy, checksums in 2 processes (0 lost)" in format_stats(b.stats())
    assert "checksums in" not in format_stats(a.stats())
    assert b.stats()["remote_hits"] == n
    workers = digest_workers(b)
    assert len(workers) == 2
    for d in (a, b):
        assert d.stop() == 0
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)  # closed with the tier


def test_checksum_processes_end_when_their_daemon_is_killed(store, start_daemon):
    d = node(start_daemon, store, remote_digest_processes=2)
    workers = digest_workers(d)
    assert len(workers) == 2
    d.kill()  # SIGKILL: nothing closes them; their input ends
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in workers), 10.0,
             "the checksum processes to end after their daemon")


def digest_workers(d) -> list:
    """Pids of daemon ``d``'s checksum processes (children of its pid)."""
    pid = d.proc.pid
    out = []
    for child in os.listdir("/proc"):
        try:
            with open(f"/proc/{child}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"kvd.tiers.remote.digest_worker" in cmd:
            out.append(int(child))
    return out


def test_a_damaged_value_is_a_miss_never_served_and_its_slot_is_freed(store, start_daemon,
                                                                      procs):
    """Three chunks of one sequence, each damaged in the store another way: a payload byte, a
    header byte, a byte cut off. The lookup trusts the store's exists answer; the load
    fetches, refuses and loads nothing: its pages keep their poison (checked in the worker).
    Node B checks in checksum processes: they catch every damaged payload too."""
    a, b = node(start_daemon, store), node(start_daemon, store, remote_digest_processes=2)
    ra, rb, model = str(a.runtime_dir), str(b.runtime_dir), "remote/zero-copy/damaged"
    names = procs.apply(R.store_names, (ra, SPEC, 43, 3, 1, model, PREFIX))
    assert procs.apply(D.store_seqs, (ra, SPEC, 43, 3, 1, model, False)) == 3 * CHUNK
    wait_remote(a, lambda r: r["puts"] == 3, "node A's puts")

    def flip(at: int):
        def change(value: bytearray) -> bytearray:
            value[at] ^= 0x40
            return value
        return change
    rewrite(store, names[:1], flip(-1))  # the payload's last byte
    rewrite(store, names[1:2], flip(40))  # inside the header's key
    rewrite(store, names[2:], lambda v: v[:-1])  # a value of another size
    got = procs.apply(D.load_seqs, (rb, SPEC, 43, 3, 1, model))
    assert got == [(CHUNK, 0)] * 3  # the store said yes; verification said no
    # each bad value counts once: the lookup fetched it, the load that follows does not
    # fetch it again (dropped values are no hits while their delete may lag); the short one
    # never gives a head (Mooncake refuses it, or moves it and its size says no)
    r = wait_remote(b, lambda r: r["corrupt"] >= 3, "the three values counted corrupt")
    assert r["promotions"] == 0 and r["zero_copy_gets"] == 2 and r["corrupt"] == 3
    assert r["digests_in_processes"] == 1 and r["digests_in_threads"] == 0  # the payload's flip
    assert procs.apply(D.load_seqs, (rb, SPEC, 43, 3, 1, model)) == [(0, 0)] * 3  # deleted
    assert remote(b)["corrupt"] == 3
    host = b.stats()["tiers"]["host"]
    assert host["chunks"] == host["entries"] == host["used_bytes"] == 0  # every reserved slot was freed
    assert "failed verification" in b.log()
    # node A still holds the good bytes: a load there is exact
    assert procs.apply(D.load_seqs, (ra, SPEC, 43, 3, 1, model)) == [(CHUNK, CHUNK)] * 3


def test_a_daemon_without_the_path_falls_back_and_shares_both_ways(store, start_daemon, procs):
    """The bytes path (what a refused registration falls back to) and the zero-copy path put
    the same values: each node loads what the other stored, byte for byte."""
    plain = node(start_daemon, store, **{f"remote_{store.backend}_zero_copy": "false"})
    fast = node(start_daemon, store)
    assert remote(plain)["zero_copy"] is False and plain.log().count(off(store)) == 1
    assert on(store) not in plain.log() and remote(fast)["zero_copy"] is True
    rp, rf, model = str(plain.runtime_dir), str(fast.runtime_dir), "remote/zero-copy/fallback"
    assert procs.apply(D.store_seqs, (rp, SPEC, 45, 2, 3, model, False)) == 6 * CHUNK
    wait_remote(plain, lambda r: r["puts"] == 6, "the plain node's puts")
    assert procs.apply(D.load_seqs, (rf, SPEC, 45, 2, 3, model)) == [(3 * CHUNK, 3 * CHUNK)] * 2
    assert remote(fast)["zero_copy_gets"] == 6
    assert procs.apply(D.store_seqs, (rf, SPEC, 46, 2, 3, model, False)) == 6 * CHUNK
    wait_remote(fast, lambda r: r["zero_copy_puts"] == 6, "the zero-copy node's puts")
    before = calls(store)
    assert procs.apply(D.load_seqs, (rp, SPEC, 46, 2, 3, model)) == [(3 * CHUNK, 3 * CHUNK)] * 2
    if store.backend == "redis":  # 16 KiB values on the bytes path: MGET batches, no GET each
        after = calls(store)
        assert after["mget"] >= before["mget"] + 2 and after["get"] == before["get"]
    r = remote(plain)
    assert r["gets"] == r["promotions"] == 6 and r["zero_copy_gets"] == r["zero_copy_puts"] == 0
    for d in (plain, fast):
        assert d.stop() == 0
