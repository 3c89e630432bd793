"""The zero-copy remote path: chunks move between the host arena and Mooncake, no bytes copy.

Taken by kvd/tiers/remote_tiering.py for each put and fetch while the
store says ``zero_copy`` (the arena is registered with it,
kvd/tiers/remote_mooncake.py); otherwise values go through Python bytes.
The stored value is the same on both paths (kvd/tiers/remote_value.py:
header, tag with a seal, payload), so nodes on either path share it.

- **Put** (``publish``): the entry is pinned, a CPU thread computes the
  value's head over the payload where it lies in the arena (digest, and the
  keyed tag of a seal), and the store sends head and payload from their
  registered memory. The pin is dropped only when the store's call
  returned, not when the tier gave up on it at its timeout: an abandoned
  call may still be reading the slot, and a slot must not be reused under
  it (the other bytes would go out under this chunk's head; readers would
  refuse them, but they would cost a fetch). So the entry stays pinned for
  the network IO too, unlike on the bytes path.
- **Fetch** (``promote``, the chunk's geometry known): the host entry is
  reserved first (invisible to lookups and loads), the store writes the
  value's payload straight into its slot and its head into a head slot, a
  CPU thread checks the head (key, namespace, geometry, length) and the
  payload digest (and tag) over the slot, and only then is the entry
  committed. Anything else (absent, a failed or timed-out call, a value of
  another size, a failed check) aborts the reservation: a miss, never
  served. A value that fails its check, or has another size, is counted
  ``corrupt`` and deleted from the store. An abandoned call may still write
  into the slot, so the slot is freed only when the call returned.
Runs on the event loop; the store's calls on the remote tier's threads.
"""

from __future__ import annotations

import asyncio

from kvd.tiers.chunk_file import ChunkCorrupt
from kvd.tiers.remote_value import head_bytes, make_head, verify_in_place


async def publish(t, entry, cold: bool, checked: bool) -> bool | None:
    """Put ``entry`` (ready, in the host tier) through tiering ``t`` without copying its
    payload: True sent, False the store had it, None failed."""
    host, remote = t.host, t.remote
    host.pin([entry])
    pinned_at = host.clock

    def unpin() -> None:  # a demoted entry nobody used meanwhile goes back to the cold end
        host.unpin([entry], cold_since=pinned_at if cold else None)

    asked = False
    try:
        head = await remote.cpu(make_head, entry.ns, entry.key, _slot(t, entry), entry.shards,
                                entry.shard_bytes, t.seal)
        async with t.put_slots:
            asked = True  # from here ``put_from`` calls ``unpin`` once, when the store is done
            return await remote.put_from(entry.ns, entry.key, head, t.base + entry.offset,
                                         entry.size, checked, unpin)
    finally:
        if not asked:
            unpin()


async def promote(t, ns: bytes, key: bytes, shards: int, shard_bytes: int) -> bool:
    """Fetch chunk ``key`` of ``ns`` into a new host entry through tiering ``t``; True once
    it is committed, verified."""
    entry, ranks = t._reserve(key, ns, shard_bytes, shards)
    if entry is None:
        return False
    host, remote = t.host, t.remote
    landed = asyncio.get_running_loop().create_future()  # the store's call returned

    def settle(ok: bool) -> None:
        for rank in ranks:
            (host.commit if ok else host.abort)(entry, rank)

    def on_done() -> None:
        if not landed.done():
            landed.set_result(None)

    asked, head = False, None
    try:
        async with t.fetch_slots:  # in key order: a load's first chunks come first
            asked = True  # from here ``get_into`` calls ``on_done`` once
            head = await remote.get_into(ns, key, head_bytes(t.seal), t.base + entry.offset,
                                         entry.size, on_done)
    finally:
        if not isinstance(head, bytes):  # a miss; the slot is freed once nothing writes it
            if asked:
                landed.add_done_callback(lambda _: settle(False))
            else:
                settle(False)
    if head is None:
        t.counters["promotions_failed"] += 1
        return False
    if isinstance(head, int):
        return t._corrupt(ns, key, ChunkCorrupt(f"value is {head} bytes, this namespace's "
                                                f"are {head_bytes(t.seal) + entry.size}"))
    ok = False
    try:
        await remote.cpu(verify_in_place, head, ns, key, shards, shard_bytes, _slot(t, entry),
                         t.seal)
        ok = True
    except ChunkCorrupt as exc:
        t._corrupt(ns, key, exc)
    finally:
        settle(ok)
    if ok:
        t.counters["promotions"] += 1
    return ok


def _slot(t, entry):
    return t.view[entry.offset:entry.offset + entry.size]
