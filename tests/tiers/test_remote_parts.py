"""The remote tier's parts without a daemon: value format, breaker, daemon threads, IO.

The value format must carry the disk file's fields and checksums and refuse
every corruption before a byte reaches a host slot; the breaker must open
after its threshold, stay open until its probe says otherwise, and let no
late answer close it; the daemon threads must never keep a process from
exiting; ``RemoteTier`` runs against a real redis-server (skipped without
one) and must bound every call by its timeout when the server is frozen.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvd.tiers.daemon_threads import DaemonThreads
from kvd.tiers.disk import chunk_file as F
from kvd.tiers.remote.breaker import Breaker
from kvd.tiers.remote.calls import RemoteUnavailable
from kvd.tiers.remote.store import RedisStore
from kvd.tiers.remote.tier import RemoteTier
from kvd.tiers.remote.value import TAG_BYTES, Seal, copy_verified, pack, parse, store_name
from kvd.tiers.scope import Scope

NS = bytes(range(16))
KEY = bytes(range(16, 32))


def payload(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# ---- value format ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 4096, 70_000])
def test_value_round_trip_has_the_disk_files_header_and_digest(tmp_path, n):
    data = payload(n)
    value = pack(NS, KEY, data, 2, n // 2 if n % 2 == 0 else n) if n % 2 == 0 else \
        pack(NS, KEY, data, 1, n)
    head = parse(value, NS, KEY)
    assert head.length == n and len(value) == F.HEADER.size + n
    out = np.zeros(n, np.uint8)
    copy_verified(value, head, out)
    assert (out == data).all()
    files = F.ChunkFiles(tmp_path, direct=False)  # the same chunk on disk: same header fields
    disk = F.read_header(files.write(NS, KEY, data, head.shards, head.shard_bytes))
    assert disk == head


@pytest.mark.parametrize("where", ["magic", "version", "ns", "key", "length", "digest",
                                   "header_check", "payload_first", "payload_last"])
def test_every_corruption_is_refused_and_the_slot_is_untouched(where):
    n = 3 * 4096 + 5
    value = bytearray(pack(NS, KEY, payload(n), 1, n))
    offsets = {"magic": 0, "version": 8, "ns": 16, "key": 32, "length": 48, "digest": 68,
               "header_check": 84, "payload_first": F.HEADER.size,
               "payload_last": len(value) - 1}
    value[offsets[where]] ^= 0x01
    out = np.full(n, 7, np.uint8)
    with pytest.raises(F.ChunkCorrupt):
        copy_verified(value, parse(value, NS, KEY), out)
    assert (out == 7).all()


def test_a_value_of_another_chunk_or_length_is_refused():
    value = pack(NS, KEY, payload(100), 1, 100)
    with pytest.raises(F.ChunkCorrupt, match="another chunk"):
        parse(value, NS, bytes(16))
    with pytest.raises(F.ChunkCorrupt, match="bytes"):
        parse(bytes(value)[:-1], NS, KEY)
    with pytest.raises(F.ChunkCorrupt):
        parse(b"short", NS, KEY)
    assert store_name("c1", NS, KEY) != store_name("c2", NS, KEY)
    assert store_name("c1", NS, KEY).startswith("c1/" + NS.hex() + "/")


def test_a_sealed_value_verifies_only_with_its_secret():
    n, seal = 70_000, Seal("cluster secret")
    data = payload(n)
    value = pack(NS, KEY, data, 1, n, seal)
    assert len(value) == F.HEADER.size + TAG_BYTES + n
    out = np.zeros(n, np.uint8)
    copy_verified(value, parse(value, NS, KEY, seal), out, seal)
    assert (out == data).all()
    # re-packed by someone without the secret: valid checksums, other bytes
    forged = [pack(NS, KEY, payload(n, 2), 1, n), pack(NS, KEY, payload(n, 2), 1, n, Seal("x"))]
    out[:] = 7
    with pytest.raises(F.ChunkCorrupt, match="keyed tag"):
        parse(forged[0], NS, KEY, seal)  # no room for a tag: refused on its length
    with pytest.raises(F.ChunkCorrupt, match="keyed tag mismatch"):
        copy_verified(forged[1], parse(forged[1], NS, KEY, seal), out, seal)
    assert (out == 7).all()
    with pytest.raises(F.ChunkCorrupt):  # and a sealed value is no plain one
        parse(value, NS, KEY)
    assert Seal("cluster secret").key_id == seal.key_id != Seal("x").key_id


# ---- breaker ----------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_starts_open_and_only_its_probe_closes_it():
    clock = Clock()
    b = Breaker(3, 2.0, clock)
    assert not b.allow() and b.probe_due() and b.state == "probing"
    b.success()
    assert b.allow()
    assert not b.failure() and not b.failure()
    b.success()  # resets the count
    assert not b.failure() and not b.failure() and b.failure()  # the third in a row opens it
    assert b.state == "open" and b.opened == 1 and not b.allow()
    b.success()  # a late answer to a call sent before it opened
    assert b.state == "open" and not b.probe_due()
    clock.now = 2.0
    assert b.probe_due()
    assert not b.failure() and b.state == "open" and b.opened == 1  # probe failed: open again
    assert not b.probe_due()
    clock.now = 4.0
    assert b.probe_due()
    b.success()
    assert b.allow() and b.failures == 0


# ---- daemon threads -----------------------------------------------------------------------

def test_daemon_threads_count_busy_calls_and_never_hold_the_process():
    pool = DaemonThreads(2, "t")
    gate = threading.Event()
    futs = [pool.submit(gate.wait, 10) for _ in range(3)]
    assert pool.busy == 3
    gate.set()
    assert [f.result(5) for f in futs] == [True] * 3
    deadline = time.monotonic() + 5
    while pool.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.busy == 0
    pool.close()
    code = ("import time; from kvd.tiers.daemon_threads import DaemonThreads; "
            "DaemonThreads(1, 'x').submit(time.sleep, 60); print('bye')")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=30)
    assert out.stdout.strip() == "bye" and time.monotonic() - t0 < 20


# ---- remote tier IO against a real redis-server (the ``redis_server`` fixture) --------------

def run(coro):
    return asyncio.run(coro)


def test_remote_tier_round_trip_bounds_calls_and_opens_its_breaker(redis_server):
    async def scenario():
        tier = RemoteTier(RedisStore(redis_server.url, 0.2), "unit", 0.2, 2, 3, 0.1)
        tier.start()
        while not tier.breaker.allow():
            await asyncio.sleep(0.01)
        keys = [bytes([i]) * 16 for i in range(3)]
        value = pack(NS, keys[0], payload(5000), 1, 5000)
        assert await tier.put(NS, keys[0], value) is True
        assert await tier.put(NS, keys[0], value) is False  # present: not sent again
        assert await tier.exists_prefix(NS, keys) == 1
        assert bytes(await tier.get(NS, keys[0])) == bytes(value)
        assert await tier.get(NS, keys[1]) is None
        redis_server.freeze()
        t0 = time.monotonic()
        for _ in range(6):  # three time out, then the open breaker refuses at once
            assert await tier.exists_prefix(NS, keys) == 0
        waited = time.monotonic() - t0
        state = tier.breaker.state
        c = tier.counters.copy()
        redis_server.thaw()
        while not tier.breaker.allow():
            await asyncio.sleep(0.01)
        assert await tier.exists_prefix(NS, keys) == 1
        await tier.stop()
        return waited, state, c, tier.closed

    waited, state, c, closed = run(scenario())
    assert state in ("open", "probing") and c["timeouts"] + c["errors"] == 3
    assert c["skipped"] == 3 and c["puts"] == 1 and c["puts_present"] == 1
    assert waited < 3.0 and closed  # three timeouts of 0.2 s, not the client's defaults


def test_redis_sends_large_values_through_redis_pys_own_serializer(redis_server):
    """Also where hiredis is installed: its serializer copies a large value into one string
    (4 MiB puts measured 3-4 times slower); hiredis still parses the replies."""
    from redis.connection import PythonRespSerializer
    store = RedisStore(redis_server.url, 5.0)
    store.connect()
    try:
        packer = store.client.connection_pool.connection_kwargs["command_packer"]
        assert isinstance(packer, PythonRespSerializer)
        value = pack(NS, KEY, payload(4 << 20), 1, 4 << 20)  # a view, as the tier sends it
        store.put("unit/large", value)
        assert store.get("unit/large") == bytes(value)
        store.delete("unit/large")
    finally:
        store.close()


def test_a_call_is_refused_when_every_thread_is_stuck():
    async def scenario():
        tier = RemoteTier(RedisStore("redis://127.0.0.1:1/0", 0.1), "unit", 0.1, 2, 100, 60)
        assert tier.breaker.probe_due()
        tier.breaker.success()  # as if a probe had passed
        gate = threading.Event()
        stuck = [asyncio.ensure_future(tier.call(gate.wait, 30)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(RemoteUnavailable):
            await tier.call(gate.wait, 30)
        busy = tier.counters["busy"]
        await asyncio.gather(*stuck, return_exceptions=True)  # they time out
        gate.set()
        return busy, tier.counters["timeouts"]

    assert run(scenario()) == (1, 2)


def test_a_long_prefix_is_fetched_whole_with_few_threads(redis_server):
    """20 chunks through 2 remote threads (1 fetches at a time): every one arrives, verified,
    none refused for want of a thread; the host slots hold the published bytes."""
    from kvd.tiers.host.tier import HostTier
    from kvd.tiers.remote.tiering import RemoteTiering

    size, n = 8192, 20

    async def scenario():
        view = np.zeros(4 * n * size, np.uint8)
        host = HostTier(len(view), 4096)
        keys = [bytes([i]) * 16 for i in range(n)]
        todo, _ = host.reserve_many(keys, NS, size, 1, 0)
        for i, e in todo:
            view[e.offset:e.offset + size] = payload(size, seed=i)
            host.commit(e, 0)
        tier = RemoteTier(RedisStore(redis_server.url, 1.0), "unit", 1.0, 2, 3, 0.1)
        tiering = RemoteTiering(host, tier, view, "store", n)
        tiering.start()
        while not tier.breaker.allow():
            await asyncio.sleep(0.01)
        tiering.stored([e for _, e in todo])
        await asyncio.gather(*list(tiering.publishing.values()))
        host.clear()
        assert await tiering.lookup(Scope(NS, 1, size), keys) == n
        got = await tiering.promote_prefix(Scope(NS, 1, size), keys)
        same = [bool((view[e.offset:e.offset + size] == payload(size, seed=i)).all())
                for i, e in enumerate(got)]
        host.unpin(got)
        await tiering.stop()
        return len(got), same, tier.counters.copy(), tiering.stats()

    count, same, counters, stats = run(scenario())
    assert count == n and all(same), stats
    assert counters["busy"] == 0 and counters["puts"] == n and stats["promotions"] == n


# ---- configuration ---------------------------------------------------------------------------

def test_demote_publication_needs_a_disk_tier():
    from kvd.config import load_config
    from kvd_protocol.errors import ConfigError
    with pytest.raises(ConfigError, match="remote_publish"):
        load_config(env={}, overrides={"remote_backend": "redis", "remote_publish": "demote"})
    cfg = load_config(env={}, overrides={"remote_backend": "redis", "remote_publish": "demote",
                                         "disk_dir": "/tmp/x"})
    assert cfg.remote_publish == "demote"


@pytest.mark.parametrize("knobs, says", [
    ({"remote_backend": "redis"}, "remote_address: remote_backend = redis needs the store's address"),
    ({"remote_backend": "redis", "remote_address": "http://x:1"}, "a Valkey/Redis address is a URL"),
    ({"remote_backend": "mooncake", "remote_address": "nohost"}, "expected host:port"),
])
def test_a_bad_remote_setting_stops_start_up_with_one_line(start_daemon, knobs, says):
    d = start_daemon(wait=False, **knobs)
    assert d.proc.wait(30) == 2
    assert says in d.log()
