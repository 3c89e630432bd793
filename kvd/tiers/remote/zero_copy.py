"""The zero-copy remote path: chunks move between the host arena and the store, no bytes copy.

Used by kvd.tiers.remote.tiering while the store says ``zero_copy`` (Mooncake: arena
registered; Redis: kvd.tiers.remote.redis_arena). Same stored value as the bytes path; a run of
chunks (``batch_chunks``) moves in one store call. Put: entries pinned, heads computed over
the payloads in place (digests maybe in kvd.tiers.remote.digest_pool), pins dropped only when the
store's call returned, never at the tier's timeout. Fetch: entries reserved first, payloads
written into their slots, each checked in key order before its commit; anything else is a
miss, never served; a bad value is counted once and deleted; a miss's slot is freed only
when the call returned. Runs on the event loop; store calls on the tier's threads.
"""

from __future__ import annotations

import asyncio

from kvd.tiers.disk.chunk_file import ChunkCorrupt
from kvd.tiers.remote.value import head_bytes, make_head, verify_in_place

BATCH_BYTES = 16 << 20  # payload bytes one store call moves at most (a single larger chunk alone)
# unless the store says otherwise (``batch_bytes``: Redis, one connection a call, serves a
# pipeline of multi-MiB values slower than the same values on parallel connections)
BATCH_CHUNKS = 32  # and chunks


def batch_chunks(t, chunk_bytes: int) -> int:
    """Chunks of ``chunk_bytes`` one store call of tiering ``t`` moves: also few enough that
    every network thread's call (an abandoned one too) has its heads' slots."""
    store, threads = t.remote.store, t.remote.net.size
    most = getattr(store, "batch_bytes", BATCH_BYTES)
    slots = getattr(store, "head_slots", BATCH_CHUNKS * threads)
    return max(1, min(BATCH_CHUNKS, most // max(1, chunk_bytes), slots // threads))


async def publish(t, entries: list, cold: bool, checked: bool) -> list:
    """Put ``entries`` (ready, in the host tier) through tiering ``t`` in one store call
    without copying their payloads: per entry True sent, False the store had it, None
    failed."""
    host, remote = t.host, t.remote
    host.pin(entries)
    pinned_at = host.clock

    def unpin() -> None:  # a demoted entry nobody used meanwhile goes back to the cold end
        host.unpin(entries, cold_since=pinned_at if cold else None)

    asked = False
    try:
        heads = await remote.cpu(_heads, t, entries)
        async with t.put_slots:
            asked = True  # from here ``put_from`` calls ``unpin`` once, when the store is done
            return await remote.put_from([remote.name(e.ns, e.key) for e in entries], heads,
                                         [t.base + e.offset for e in entries],
                                         [e.size for e in entries], checked, unpin)
    finally:
        if not asked:
            unpin()


def _heads(t, entries: list) -> list:
    return [make_head(e.ns, e.key, _slot(t, e), e.shards, e.shard_bytes, t.seal, _digest_of(t, e))
            for e in entries]


def promote(t, ns: bytes, keys: list, shards: int, shard_bytes: int) -> dict:
    """Start fetching ``keys`` of ``ns`` into new host entries through tiering ``t``, one
    store call: a future per key, True once its entry is committed, verified."""
    loop = asyncio.get_running_loop()
    futs = {key: loop.create_future() for key in keys}
    task = asyncio.ensure_future(_promote(t, ns, shards, shard_bytes, futs))
    t.batches.add(task)
    task.add_done_callback(t.batches.discard)
    return futs


async def _promote(t, ns: bytes, shards: int, shard_bytes: int, futs: dict) -> None:
    host, remote = t.host, t.remote
    todo: dict = {}  # key: (entry, shard ranks), reserved and not settled yet
    heads: dict = {}  # key: what the store answered for it
    landed = asyncio.get_running_loop().create_future()  # the store's call returned

    def settle(entry, ranks, ok: bool) -> None:
        for rank in ranks:
            (host.commit if ok else host.abort)(entry, rank)

    def on_done() -> None:
        if not landed.done():
            landed.set_result(None)

    asked = False
    try:
        for key, fut in futs.items():
            entry = host.entries.get(key)
            if entry is not None:  # stored or fetched meanwhile: whose, ``hold_ready`` checks
                fut.set_result(entry.ready)
                continue
            entry, ranks = t._reserve(key, ns, shard_bytes, shards)
            if entry is None:
                fut.set_result(False)
            else:
                todo[key] = (entry, ranks)
        if not todo:
            return
        async with t.fetch_slots:  # in key order: a load's first chunks come first
            asked = True  # from here ``get_into`` calls ``on_done`` once
            heads = dict(zip(todo, await remote.get_into(
                ns, list(todo), head_bytes(t.seal), [t.base + e.offset for e, _ in todo.values()],
                shards * shard_bytes, on_done)))
        checks = {key: asyncio.ensure_future(remote.cpu(  # every CPU thread at once
            verify_in_place, heads[key], ns, key, shards, shard_bytes, _slot(t, todo[key][0]),
            t.seal, _digest_of(t, todo[key][0]))) for key in todo if isinstance(heads[key], bytes)}
        for key, check in checks.items():  # committed in key order
            entry, ranks = todo.pop(key)
            ok = False
            try:
                await check
                ok = True
            except ChunkCorrupt as exc:
                t._corrupt(ns, key, exc)
            finally:
                if not ok:  # cancelled: wait for the others, which read their slots
                    await asyncio.gather(*checks.values(), return_exceptions=True)
                settle(entry, ranks, ok)
            t.counters["promotions"] += ok
            futs[key].set_result(ok)
    finally:  # misses, and what a failure or cancellation left: freed once nothing writes them
        for key, (entry, ranks) in todo.items():
            if asked:
                landed.add_done_callback(lambda _, e=entry, r=ranks: settle(e, r, False))
            else:
                settle(entry, ranks, False)
            stored = heads.get(key)
            if isinstance(stored, int):  # a value of another size: counted once, deleted
                t._corrupt(ns, key, ChunkCorrupt(
                    f"value is {stored} bytes, this namespace's are {head_bytes(t.seal) + entry.size}"
                    + ("" if t.seal is None else " with a keyed tag")))
            else:
                t.counters["promotions_failed"] += 1
        for fut in futs.values():
            if not fut.done():
                fut.set_result(False)


def _slot(t, entry):
    return t.view[entry.offset:entry.offset + entry.size]


def _digest_of(t, entry):
    """The payload digest of ``entry``'s slot, from a checksum process where the tiering has
    one (kvd/tiers/remote/digest_pool.py), otherwise on the calling thread."""
    return lambda slot: t.digests.digest(entry.offset, slot)
