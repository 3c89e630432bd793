"""The zero-copy path's memory contract when a store call is abandoned, in process.

A real ``RemoteTiering`` and ``HostTier`` over a numpy arena, and an
in-process store with the zero-copy calls (``put_from`` reads the arena at
the pointers it is given, ``get_into`` writes them, several values a call)
whose calls a test holds
past the remote timeout. Proved: a fetch that times out is a miss at once,
but its host slot stays reserved (nothing else can be put there) until the
abandoned call returned, and is freed then, never committed; a put that
times out keeps its entry pinned (never evicted or reused) until the call
returned; once calls answer, a fetch lands byte for byte. A bad value the
store keeps (its delete lags) counts once: later lookups do not fetch it
again. A value whose transfer fails alone inside a call of several is a
miss for that chunk only, counted in ``errors``; the others land.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading

import numpy as np

from kvd.tiers.host.tier import HostTier
from kvd.tiers.remote.errors import RemoteError
from kvd.tiers.remote.tier import RemoteTier
from kvd.tiers.remote.tiering import RemoteTiering
from kvd.tiers.remote.value import pack, store_name
from kvd.tiers.scope import Scope

NS = bytes(range(16))
SIZE = 8192
TIMEOUT_S = 0.1


class ArenaStore:
    """A store in memory with the zero-copy calls; ``hold[name]``: an Event its call waits
    for; ``returned``: names whose held call returned."""

    name = address = "memory"
    zero_copy = True

    def __init__(self):
        self.values, self.hold, self.returned = {}, {}, set()
        self.kept = set()  # names whose delete does nothing (a lease or a lagging store)
        self.failing = set()  # names whose transfer fails alone, inside a call of several

    def connect(self):
        pass

    def ping(self):
        pass

    def exists(self, names):
        return [n in self.values for n in names]

    def put(self, name, value):
        self.values[name] = bytes(value)

    def delete(self, name):
        if name not in self.kept:
            self.values.pop(name, None)

    def close(self):
        pass

    def _wait(self, names):
        for name in names:
            if name in self.hold:
                self.hold[name].wait(10)
                self.returned.add(name)

    def put_from(self, names, heads, ptrs, sizes):
        self._wait(names)
        out = []
        for name, head, ptr, size in zip(names, heads, ptrs, sizes):
            if name in self.failing:
                out.append(RemoteError(f"{name}: transfer failed"))
                continue
            self.values[name] = bytes(head) + ctypes.string_at(ptr, size)
            out.append(None)
        return out

    def get_into(self, names, head_len, ptrs, size):
        self._wait(names)
        out = []
        for name, ptr in zip(names, ptrs):
            if name in self.failing:
                out.append(RemoteError(f"{name}: transfer failed"))
                continue
            value = self.values.get(name)
            if value is None or len(value) != head_len + size:
                out.append(None if value is None else len(value))
                continue
            ctypes.memmove(ptr, value[head_len:], size)
            out.append(value[:head_len])
        return out


async def tier():
    store = ArenaStore()
    view = np.zeros(8 * SIZE, np.uint8)
    host = HostTier(len(view), 4096)
    remote = RemoteTier(store, "t", TIMEOUT_S, 8, 1000, 0.05)
    tiering = RemoteTiering(host, remote, view)
    tiering.start()
    while not remote.breaker.allow():
        await asyncio.sleep(0.01)
    return store, view, host, tiering


async def until(ok, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not ok():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)


def test_a_timed_out_fetch_is_a_miss_and_its_slot_is_freed_only_after_the_call_returned():
    async def main():
        store, view, host, tiering = await tier()
        key, data = bytes(16), np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
        name = store_name("t", NS, key)
        store.values[name] = bytes(pack(NS, key, data, 1, SIZE))
        store.hold[name] = threading.Event()
        scope = Scope(NS, 1, SIZE)
        try:
            assert await tiering.promote_prefix(scope, [key]) == []  # a miss, past the timeout
            r = tiering.stats()
            assert r["timeouts"] == 1 and r["promotions"] == 0 and r["zero_copy_gets"] == 0
            entry = host.entries[key]  # still reserved: the abandoned call may write it
            assert not entry.ready and entry.writing and host.alloc.used == SIZE
            store.hold[name].set()
            await until(lambda: key not in host.entries)
            assert name in store.returned and host.alloc.used == 0 and host.ready_count == 0
            del store.hold[name]
            got = await tiering.promote_prefix(scope, [key])  # answered now: byte exact
            assert len(got) == 1 and tiering.stats()["zero_copy_gets"] == 1
            assert (view[got[0].offset:got[0].offset + SIZE] == data).all()
            host.unpin(got)
        finally:
            for event in store.hold.values():
                event.set()
            await tiering.stop()
    asyncio.run(main())


def test_a_timed_out_put_keeps_its_entry_pinned_until_the_call_returned():
    async def main():
        store, view, host, tiering = await tier()
        key = bytes(range(1, 17))
        (_, entry), = host.reserve_many([key], NS, SIZE, 1, 0, 0)[0]
        view[entry.offset:entry.offset + SIZE] = 7
        host.commit(entry, 0)
        name = store_name("t", NS, key)
        store.hold[name] = threading.Event()
        try:
            tiering.stored([entry])
            await until(lambda: tiering.stats()["puts_failed"] == 1)
            assert tiering.stats()["timeouts"] == 1 and entry.refs == 1  # pinned: still read
            assert host.clear() == (0, 1)  # in use: not evicted
            store.hold[name].set()
            await until(lambda: entry.refs == 0)
            assert name in store.returned and store.values[name][-SIZE:] == bytes([7]) * SIZE
            assert host.clear() == (1, 0)
        finally:
            store.hold[name].set()
            await tiering.stop()
    asyncio.run(main())


def test_a_bad_value_whose_delete_lags_is_fetched_and_counted_once():
    async def main():
        store, view, host, tiering = await tier()
        key, data = bytes(16), np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
        name = store_name("t", NS, key)
        value = bytearray(pack(NS, key, data, 1, SIZE))
        value[-1] ^= 0x40
        store.values[name] = bytes(value)
        store.kept.add(name)  # the store still says it has it after the delete
        try:
            for _ in range(3):
                assert await tiering.promote_prefix(Scope(NS, 1, SIZE), [key]) == []
            r = tiering.stats()
            assert r["corrupt"] == 1 and r["zero_copy_gets"] == 1 and r["promotions"] == 0
            assert name in store.values and host.alloc.used == 0
        finally:
            await tiering.stop()
    asyncio.run(main())


def test_one_failed_value_of_a_batch_is_a_miss_for_it_alone():
    async def main():
        store, view, host, tiering = await tier()
        keys = [bytes([i]) * 16 for i in range(1, 5)]
        for i, key in enumerate(keys):
            (_, entry), = host.reserve_many([key], NS, SIZE, 1, 0, 0)[0]
            view[entry.offset:entry.offset + SIZE] = i + 1
            host.commit(entry, 0)
        store.failing.add(store_name("t", NS, keys[1]))
        try:
            tiering.stored([host.entries[k] for k in keys])  # one put call for the four
            await until(lambda: tiering.stats()["puts"] + tiering.stats()["puts_failed"] == 4)
            r = tiering.stats()
            assert r["zero_copy_puts"] == 3 and r["puts_failed"] == 1 and r["errors"] == 1
            store.failing.clear()
            store.values[store_name("t", NS, keys[1])] = bytes(
                pack(NS, keys[1], np.full(SIZE, 2, np.uint8), 1, SIZE))
            assert host.clear() == (4, 0)
            store.failing.add(store_name("t", NS, keys[2]))
            got = await tiering.promote_prefix(Scope(NS, 1, SIZE), keys)  # one get call
            assert [e.key for e in got] == keys[:2]  # the prefix ends at the failed value
            for i, e in enumerate(got):
                assert (view[e.offset:e.offset + SIZE] == i + 1).all()
            host.unpin(got)
            await until(lambda: keys[3] in host.entries and host.entries[keys[3]].ready)
            r = tiering.stats()
            assert r["zero_copy_gets"] == 3 and r["errors"] == 2 and r["breaker"] == "closed"
            assert keys[2] not in host.entries  # its slot was freed
        finally:
            await tiering.stop()
    asyncio.run(main())
