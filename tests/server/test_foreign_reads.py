"""Reads are checked like writes: another namespace's keys are misses on every tier.

Keys are computed by clients, so a client may send keys it learnt from
another tenant. An owner (tests/workers_foreign.py, a spawned client
process) stores chunks; readers registered under another model, weights
fingerprint, pipeline stage, TP size and rank, or shard size send the
owner's keys, through a pool of their own and through ``attach``. Every
lookup must hit nothing and every load load nothing, with the reader's
pages untouched, whether the owner's chunks sit in the host tier, on disk
or next to the reader's own chunks (disk, remote store); the daemon counts
each such request in ``foreign_ns_misses``. A reader of the owner's own
namespace hits and loads everything, so the chunks were there to find.
"""

from __future__ import annotations

import time

import workers_disk as D
import workers_foreign as F

from kvd.cli.format import format_stats

OWNER = {"model": "owner"}
READERS = {
    "other model": (F.GEOMETRY, {"model": "other"}),
    "fingerprint": (F.GEOMETRY, {"model": "owner", "fingerprint": "lora:x"}),
    "pipeline stage": (F.GEOMETRY, {"model": "owner", "first_layer": 2}),
    "tp rank 1 of 2": (F.GEOMETRY, {"model": "owner", "tp_size": 2, "tp_rank": 1}),
    "shards of 64 KiB": (F.BIG, {"model": "owner"}),
}
NOTHING = {"hits": 0, "loaded": 0, "written": []}
ALL = {"hits": 4, "loaded": 4, "written": list(range(4 * F.PPC))}


def read_all(procs, rd: str, keys: list) -> dict:
    return {name: procs.apply(F.read, (rd, geo, reg, keys)) for name, (geo, reg) in READERS.items()}


def attach_all(procs, rd: str, keys: list) -> dict:
    return {name: procs.apply(F.attach_lookup, (rd, geo, reg, keys))
            for name, (geo, reg) in READERS.items()}


def test_host_chunks_of_another_namespace_are_misses(daemon, procs):
    rd = str(daemon.runtime_dir)
    keys = procs.apply(F.store, (rd, F.GEOMETRY, OWNER, F.tokens(1, 4), 1))
    assert read_all(procs, rd, keys) == dict.fromkeys(READERS, NOTHING)
    assert attach_all(procs, rd, keys) == dict.fromkeys(READERS, 0)
    stats = daemon.stats()
    assert stats["foreign_ns_misses"] == 3 * len(READERS)  # lookup, load, attach's lookup
    assert f"other-namespace keys {3 * len(READERS)}" in format_stats(stats)
    assert procs.apply(F.read, (rd, F.GEOMETRY, OWNER, keys)) == ALL
    assert daemon.stats()["foreign_ns_misses"] == 3 * len(READERS)


def test_disk_chunks_of_another_namespace_are_misses(start_daemon, procs, tmp_path):
    d = start_daemon(disk_dir=str(tmp_path / "disk"))
    rd = str(d.runtime_dir)
    keys = procs.apply(F.store, (rd, F.GEOMETRY, OWNER, F.tokens(2, 4), 2))
    assert d.control("flush_disk")["written"] == 4
    assert d.control("clear")["dropped"] == 4  # on disk only now
    assert read_all(procs, rd, keys) == dict.fromkeys(READERS, NOTHING)
    assert attach_all(procs, rd, keys) == dict.fromkeys(READERS, 0)
    st = d.stats()
    assert st["disk_hits"] == 0 and st["tiers"]["host"]["entries"] == 0  # nothing promoted
    assert procs.apply(F.read, (rd, F.GEOMETRY, OWNER, keys)) == ALL


def test_a_prefix_continued_from_disk_ends_at_another_namespaces_chunk(start_daemon, procs,
                                                                       tmp_path):
    """The reader's own chunk is on disk, the owner's in the host tier: a load promotes the
    reader's and stops there."""
    d = start_daemon(disk_dir=str(tmp_path / "disk"))
    rd = str(d.runtime_dir)
    reader = READERS["other model"]
    own = procs.apply(F.store, (rd, *reader, F.tokens(3, 1), 3))
    d.control("flush_disk")
    d.control("clear")
    keys = procs.apply(F.store, (rd, F.GEOMETRY, OWNER, F.tokens(4, 4), 4))
    got = procs.apply(F.read, (rd, *reader, own + keys))
    assert got == {"hits": 1, "loaded": 1, "written": list(range(F.PPC))}
    # the load met the owner's chunk in the host tier; the lookup's walk, past the host tier
    # at the reader's own chunk, found the next key on no disk and stopped there
    assert d.stats()["foreign_ns_misses"] == 1


def remote_node(start_daemon, redis_server):
    d = start_daemon(remote_backend="redis", remote_address=redis_server.url, remote_prefix="foreign",
                     remote_timeout_s=0.5, remote_breaker_retry_s=0.2)
    wait_remote(d, lambda r: r["breaker"] == "closed")
    return d


def wait_remote(d, ok, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while not ok(r := d.stats()["tiers"]["remote"]):
        assert time.monotonic() < deadline, f"{r}\n{d.log()[-3000:]}"
        time.sleep(0.02)
    return r


def test_a_prefix_continued_from_the_remote_store_ends_at_another_namespaces_chunk(
        redis_server, start_daemon, procs):
    """The reader's own chunk is in the remote store only, the owner's in the host tier (and
    in the store, under the owner's namespace): the reader gets its own chunk only."""
    d = remote_node(start_daemon, redis_server)
    rd = str(d.runtime_dir)
    reader = READERS["other model"]
    own = procs.apply(F.store, (rd, *reader, F.tokens(5, 1), 5))
    wait_remote(d, lambda r: r["puts"] == 1)
    d.control("clear")
    keys = procs.apply(F.store, (rd, F.GEOMETRY, OWNER, F.tokens(6, 4), 6))
    wait_remote(d, lambda r: r["puts"] == 5)
    got = procs.apply(F.read, (rd, *reader, own + keys))
    assert got == {"hits": 1, "loaded": 1, "written": list(range(F.PPC))}
    # the owner's chunks in the store alone: still misses for every reader
    d.control("clear")
    assert read_all(procs, rd, keys) == dict.fromkeys(READERS, NOTHING)
    assert D.control(rd, "stats")["tiers"]["remote"]["corrupt"] == 0
