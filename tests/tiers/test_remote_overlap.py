"""A load's remote part overlapped with its copies (kvd/server/remote_load.py), in process.

A real ``RemoteTiering`` and ``HostTier`` over a numpy arena fetch from an
in-process store whose GETs a test holds back or slows past the remote
timeout; the engine is a recorder of queued scatter plans. Proved: the
local prefix's copy is queued before any remote fetch landed, each remote
run's copy is queued as its fetch lands, in key order, and the load's signal
goes only with the last piece after every earlier one landed; a fetch that
times out (or fails) ends the load there: later chunks, fetched or not, are
never copied, no error is raised, and the signal still goes out. And a put's
value buffer is reused only after a put that finished, never a failed one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np

from kvd.server.remote_load import Pieces, queue_pieces
from kvd.tiers.host.tier import HostTier
from kvd.tiers.remote.tier import RemoteTier
from kvd.tiers.remote.tiering import RemoteTiering
from kvd.tiers.remote.value import pack, store_name
from kvd.tiers.scope import Scope

NS = bytes(range(16))
SIZE = 4096
PPC = 2
TIMEOUT_S = 0.2


class HeldStore:
    """A store in memory; ``hold[name]``: an Event its GET waits for; ``slow``: names whose
    GET answers only after the remote timeout."""

    name, address = "memory", "memory"

    def __init__(self):
        self.values, self.hold, self.slow = {}, {}, set()

    def connect(self):
        pass

    def ping(self):
        pass

    def exists(self, names):
        return [n in self.values for n in names]

    def get(self, name):
        if name in self.hold:
            self.hold[name].wait(10)
        if name in self.slow:
            time.sleep(3 * TIMEOUT_S)
        return self.values.get(name)

    def put(self, name, value):
        self.values[name] = bytes(value)

    def delete(self, name):
        self.values.pop(name, None)

    def close(self):
        pass


class Recorder:
    """The engine: every scatter plan queued, landing at once (bytes copied by numpy)."""

    def __init__(self):
        self.plans = []

    async def scatter(self, plan):
        self.plans.append((len(plan.shard_offsets), plan.signal is not None, time.monotonic()))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


async def start_tier(n_local: int, n_remote: int):
    store = HeldStore()
    view = np.zeros(4 * (n_local + n_remote) * SIZE, np.uint8)
    host = HostTier(len(view), 4096)
    remote = RemoteTier(store, "t", TIMEOUT_S, 8, 1000, 0.05)
    tiering = RemoteTiering(host, remote, view)
    keys = [i.to_bytes(16, "big") for i in range(n_local + n_remote)]
    for i, key in enumerate(keys):
        data = np.full(SIZE, i, np.uint8)
        if i < n_local:
            (_, entry), = host.reserve_many([key], NS, SIZE, 1, 0, 0)[0]
            view[entry.offset:entry.offset + SIZE] = data
            host.commit(entry, 0)
        else:
            store.values[store_name("t", NS, key)] = bytes(pack(NS, key, data, 1, SIZE))
    tiering.start()
    while not remote.breaker.allow():
        await asyncio.sleep(0.01)
    return store, host, tiering, keys


async def load(host, tiering, keys, n_local: int, engine: Recorder):
    scope = Scope(NS, 1, SIZE)
    entries = host.ready_prefix(keys, scope)
    host.pin(entries)
    fetches = await tiering.fetches(scope, keys[n_local:])
    signal = SimpleNamespace(cancelled=False, layerwise=False)
    reg = SimpleNamespace(pages_per_chunk=PPC, pool=None, layout=None, tp_rank=0, closing=False,
                          shard_bytes=SIZE, ns=SimpleNamespace(chunk_tokens=16), engine=engine)

    async def start(_reg, coro, *_):
        return await coro
    tr = SimpleNamespace(_start=start, remote=tiering)
    pieces = Pieces()
    pages = np.arange(len(keys) * PPC)
    await queue_pieces(tr, reg, pages, keys, entries, 0, pages[:n_local * PPC], fetches, signal,
                       {}, pieces, scope)
    return entries, pieces


def test_local_copy_goes_first_and_each_remote_run_as_it_lands():
    async def go():
        store, host, tiering, keys = await start_tier(2, 3)
        gate = threading.Event()
        store.hold[store_name("t", NS, keys[3])] = gate  # the second remote chunk waits
        engine = Recorder()
        task = asyncio.ensure_future(load(host, tiering, keys, 2, engine))
        deadline = time.monotonic() + 5
        while len(engine.plans) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        # the local prefix and the first remote chunk are queued while chunk 3 is held
        assert engine.plans == [(2, False, engine.plans[0][2]), (1, False, engine.plans[1][2])]
        gate.set()
        entries, pieces = await task
        assert [k for k in (e.key for e in entries)] == keys
        counts = [(n, sig) for n, sig, _ in engine.plans]
        assert sum(n for n, _ in counts) == 5 and counts[-1][1] and not any(s for _, s in counts[:-1])
        assert pieces.signalled and pieces.chunks == 5
        host.unpin(entries)
        await tiering.stop()
    asyncio.run(go())


def test_a_fetch_that_times_out_ends_the_load_there_without_an_error():
    async def go():
        store, host, tiering, keys = await start_tier(2, 3)
        store.slow.add(store_name("t", NS, keys[3]))  # past the timeout: a miss
        engine = Recorder()
        entries, pieces = await load(host, tiering, keys, 2, engine)
        assert [e.key for e in entries] == keys[:3]  # the local two and the first remote one
        assert pieces.chunks == 3 and pieces.signalled
        # the last plan carries only the signal: chunk 4, fetched fine, is never copied
        assert [(n, sig) for n, sig, _ in engine.plans] == [(2, False), (1, False), (0, True)]
        assert tiering.remote.counters["timeouts"] == 1
        host.unpin(entries)
        await tiering.stop()
    asyncio.run(go())


class FailingPuts(HeldStore):
    """Puts of names in ``fail`` raise (after the probe's put went through)."""

    def __init__(self):
        super().__init__()
        self.fail = set()

    def put(self, name, value):
        if name in self.fail:
            raise ConnectionError("put refused")
        super().put(name, value)


def test_put_buffers_are_reused_only_after_a_finished_put():
    """A value buffer goes back to the pool after a put that finished (sent or found
    there), never after one that failed: an abandoned call may still read it."""
    async def go():
        store = FailingPuts()
        view = np.zeros(8 * SIZE, np.uint8)
        host = HostTier(len(view), 4096)
        remote = RemoteTier(store, "t", TIMEOUT_S, 8, 1000, 0.05)
        tiering = RemoteTiering(host, remote, view)
        tiering.start()
        while not remote.breaker.allow():
            await asyncio.sleep(0.01)
        keys = [bytes([i]) * 16 for i in range(2)]
        todo, _ = host.reserve_many(keys, NS, SIZE, 1, 0)
        for _, entry in todo:
            host.commit(entry, 0)
        store.fail.add(store_name("t", NS, keys[1]))
        tiering.offer(todo[1][1])
        await asyncio.gather(*list(tiering.publishing.values()))
        assert remote.counters["puts_failed"] == 1 and not any(tiering.buffers.free.values())
        tiering.offer(todo[0][1])
        await asyncio.gather(*list(tiering.publishing.values()))
        assert remote.counters["puts"] == 1 and sum(map(len, tiering.buffers.free.values())) == 1
        reused = tiering.buffers.free[len(store.values[store_name("t", NS, keys[0])])][0]
        assert bytes(reused) == store.values[store_name("t", NS, keys[0])]
        await tiering.stop()
    asyncio.run(go())
