"""The host tier's index (kvd.tiers.host.tier): LRU order, pins, shards being written, capacity,
no-space behaviour, counters, and the demotion scan, against a plain reference model."""

from __future__ import annotations

import random

import pytest

from kvd.tiers.host.lru import LruQueue
from kvd.tiers.host.tier import HostTier
from kvd.tiers.scope import Scope
from kvd_protocol.errors import BadRequest, NoSpace

SLOT = 256
NS = b"n" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def store(tier: HostTier, ids, shards: int = 1, rank: int = 0, size: int = SLOT):
    todo, deduped = tier.reserve_many([key(i) for i in ids], NS, size // shards, shards, rank)
    for _, e in todo:
        tier.commit(e, rank)
    return todo, deduped


def lru_ids(tier: HostTier) -> list[int]:
    return [int.from_bytes(e.key, "little") for e in tier.lru]


def check_invariants(tier: HostTier) -> None:
    """Counters and queue agree with a brute-force look at every entry."""
    entries = list(tier.entries.values())
    queued = list(tier.lru)
    assert {id(e) for e in queued} == {id(e) for e in entries if e.evictable}
    assert len(queued) == len(tier.lru)
    assert tier.evictable_bytes == sum(e.slot_bytes for e in queued)
    st = tier.stats()
    assert st["chunks"] == sum(e.ready for e in entries)
    assert st["entries"] == len(entries)
    assert st["on_disk"] == sum(e.ready and e.on_disk for e in entries)
    assert tier.alloc.used == sum(e.slot_bytes for e in entries) <= tier.capacity
    spans = sorted((e.offset, e.offset + e.slot_bytes) for e in entries)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two entries share bytes"
    # the demotion scan: the examined prefix of the queue and its ready bytes
    examined, seen_last = 0, tier.scan_last is None
    for e in queued:
        if seen_last:
            assert e.scan != tier.scan_gen
            continue
        assert e.scan == tier.scan_gen
        examined += e.slot_bytes if e.ready else 0
        seen_last = e is tier.scan_last
    assert seen_last and examined == tier.scanned_bytes
    assert tier.cold_tail is None or tier.lru.queued(tier.cold_tail)


def test_lru_queue_links():
    class Item:
        lru_prev = lru_next = None

    q, items = LruQueue(), [Item() for _ in range(4)]
    for it in items:
        q.append(it)
    q.remove(items[1])
    q.appendleft(items[1])
    assert list(q) == [items[1], items[0], items[2], items[3]] and len(q) == 4
    assert q.first() is items[1] and q.after(items[3]) is None and q.before(items[1]) is None
    q.move_to_end(items[0])
    q.move_to_end(items[0])  # already last: no change
    assert list(q) == [items[1], items[2], items[3], items[0]]
    q.remove(items[0])
    q.insert_after(items[0], items[1])
    assert list(q) == [items[1], items[0], items[2], items[3]]
    with pytest.raises(ValueError):
        q.append(items[0])
    for it in list(q):  # removing the item just yielded is allowed
        q.remove(it)
    assert len(q) == 0 and q.first() is None and not q.queued(items[0])


def test_evicts_least_recently_used_first_and_hits_refresh():
    tier = HostTier(4 * SLOT, SLOT)
    store(tier, [0, 1, 2, 3])
    tier.ready_prefix([key(0)], Scope(NS, 1, SLOT))  # 0 becomes the most recently used
    assert lru_ids(tier) == [1, 2, 3, 0]
    store(tier, [4, 5])
    assert set(tier.entries) == {key(i) for i in (3, 0, 4, 5)}
    assert tier.stats()["evictions"] == 2
    check_invariants(tier)


def test_pinned_and_written_entries_are_never_evicted():
    tier = HostTier(4 * SLOT, SLOT)
    store(tier, [0, 1, 2])
    tier.pin([tier.entries[key(0)], tier.entries[key(1)]])
    writing, _ = tier.reserve_many([key(3)], NS, SLOT, 1, 0)  # reserved, copy in flight
    assert lru_ids(tier) == [2]
    store(tier, [4])  # evicts 2, the only evictable entry
    assert key(2) not in tier.entries
    tier.pin([tier.entries[key(4)]])
    with pytest.raises(NoSpace):
        store(tier, [5])
    assert {key(i) for i in (0, 1, 3, 4)} == set(tier.entries)
    check_invariants(tier)
    tier.commit(writing[0][1], 0)
    check_invariants(tier)


def test_unpin_returns_an_entry_at_the_most_recently_used_end():
    tier = HostTier(8 * SLOT, SLOT)
    store(tier, [0, 1, 2, 3])
    e0 = tier.entries[key(0)]
    tier.pin([e0])
    tier.pin([e0])
    assert lru_ids(tier) == [1, 2, 3]
    tier.unpin([e0])
    assert lru_ids(tier) == [1, 2, 3]  # still pinned once
    tier.unpin([e0])
    assert lru_ids(tier) == [1, 2, 3, 0]
    check_invariants(tier)


def test_a_demotion_pin_returns_to_the_cold_end_unless_used():
    tier = HostTier(8 * SLOT, SLOT)
    store(tier, [0, 1, 2, 3])
    e0, e1 = tier.entries[key(0)], tier.entries[key(1)]
    since = tier.clock
    tier.pin([e0, e1])
    tier.touch([e1])  # used while its bytes were being written to disk
    tier.unpin([e0, e1], cold_since=since)
    assert lru_ids(tier) == [0, 2, 3, 1]
    check_invariants(tier)


def test_no_space_evicts_nothing():
    tier = HostTier(6 * SLOT, SLOT)
    store(tier, range(6))
    tier.pin([tier.entries[key(i)] for i in range(3)])
    before = lru_ids(tier)
    with pytest.raises(NoSpace):  # 4 new chunks, 3 evictable slots
        store(tier, [10, 11, 12, 13])
    assert lru_ids(tier) == before and len(tier.entries) == 6
    assert tier.stats()["evictions"] == 0
    with pytest.raises(NoSpace):
        store(tier, [20], size=7 * SLOT)  # larger than the tier
    store(tier, [10, 11, 12])  # exactly what is evictable
    assert tier.stats()["evictions"] == 3
    check_invariants(tier)


def test_no_space_from_fragmentation_undoes_its_evictions():
    # slots 0..3, 1 and 3 pinned: 2 slots are evictable, but no 2 adjacent ones
    tier = HostTier(4 * SLOT, SLOT)
    store(tier, [0, 1, 2, 3])  # offsets 0, 1, 2, 3 (in slots)
    tier.pin([tier.entries[key(1)], tier.entries[key(3)]])
    before = [(e.key, e.offset) for e in tier.lru]
    with pytest.raises(NoSpace, match="fragmented"):
        store(tier, [9], size=2 * SLOT)  # 2 slots evictable, but no 2 adjacent ones
    assert [(e.key, e.offset) for e in tier.lru] == before
    assert tier.stats()["evictions"] == 0 and len(tier.entries) == 4
    check_invariants(tier)
    tier.unpin([tier.entries[key(1)]])
    store(tier, [9], size=2 * SLOT)  # now 0 and 1 are adjacent and evictable
    check_invariants(tier)


def test_a_store_evicts_only_what_it_needs_and_takes_over_the_victims_slots():
    tier = HostTier(6 * SLOT, SLOT)
    store(tier, [0], size=2 * SLOT)  # slots 0-1
    store(tier, [1, 2, 3, 4])  # slots 2..5
    offset_1 = tier.entries[key(1)].offset
    todo, _ = tier.reserve_many([key(i) for i in (10, 11, 12)], NS, SLOT, 1, 0)
    # 10 and 11 fill the two slots 0 (another size) freed; 12 takes over 1's slot
    assert tier.stats()["evictions"] == 2
    assert set(tier.entries) == {key(i) for i in (2, 3, 4, 10, 11, 12)}
    assert {tier.entries[key(10)].offset, tier.entries[key(11)].offset} == {0, SLOT}
    assert tier.entries[key(12)].offset == offset_1
    tier.commit_many([e for _, e in todo], 0)
    assert lru_ids(tier)[-3:] == [10, 11, 12]
    check_invariants(tier)


def test_no_space_undoes_slots_taken_over_and_slots_freed():
    tier = HostTier(4 * SLOT, SLOT // 2)
    half = SLOT // 2
    store(tier, [0])  # [0, SLOT)
    store(tier, [1, 2, 3, 4], size=half)  # half slots, 2 and 4 to be pinned
    store(tier, [5])  # the last SLOT
    tier.pin([tier.entries[key(2)], tier.entries[key(4)]])
    before = [(e.key, e.offset) for e in tier.lru]
    with pytest.raises(NoSpace, match="fragmented"):  # 0 and 5 hand over; 1 and 3 leave holes
        store(tier, [10, 11, 12])
    assert [(e.key, e.offset) for e in tier.lru] == before
    assert tier.stats()["evictions"] == 0 and len(tier.entries) == 6
    check_invariants(tier)


def test_dedup_and_namespace_clash_change_nothing_on_error():
    tier = HostTier(4 * SLOT, SLOT)
    store(tier, [0, 1])
    todo, deduped = store(tier, [1, 2, 2])
    assert [i for i, _ in todo] == [1] and deduped == 2
    assert tier.dedup_hits == 1
    with pytest.raises(BadRequest):
        tier.reserve_many([key(3), key(0)], b"other-namespace!", SLOT, 1, 0)
    assert key(3) not in tier.entries
    check_invariants(tier)


def test_a_lookup_ends_at_an_entry_of_another_namespace_or_geometry():
    tier = HostTier(8 * SLOT, SLOT)
    store(tier, [0, 1, 2])
    readers = {"namespace": Scope(b"other-namespace!", 1, SLOT), "shards": Scope(NS, 2, SLOT // 2),
               "shard size": Scope(NS, 1, SLOT // 2)}
    for name, scope in readers.items():
        assert tier.ready_prefix([key(0), key(1)], scope) == [], name
        assert scope.refused == 1, name
    attached = Scope(NS, 1, None)  # a registration without a pool: namespace and shards only
    assert len(tier.ready_prefix([key(0), key(1), key(5)], attached)) == 2
    assert attached.refused == 0
    check_invariants(tier)


def test_tp_shards_make_an_entry_ready_together():
    tier = HostTier(8 * SLOT, SLOT)
    store(tier, [0], shards=2, rank=0)
    e = tier.entries[key(0)]
    assert not e.ready and tier.ready_prefix([key(0)], Scope(NS, 2, SLOT // 2)) == []
    assert tier.stats()["chunks"] == 0
    todo, _ = tier.reserve_many([key(0)], NS, SLOT // 2, 2, 1)
    assert todo[0][1] is e and not e.evictable
    tier.abort(e, 1)  # rank 1's copy failed: rank 0's shard stays
    assert tier.entries[key(0)] is e and e.evictable
    store(tier, [0], shards=2, rank=1)
    assert e.ready and tier.stats()["chunks"] == 1
    check_invariants(tier)


def test_a_shard_that_failed_its_checksum_is_never_a_hit_again():
    """``drop_shard`` (verify_loads): an entry nobody uses goes with its slot; one another
    load still pins stays, not ready, until a store writes that shard again."""
    tier, reader = HostTier(8 * SLOT, SLOT), Scope(NS, 1, SLOT)
    store(tier, [0, 1, 2])
    while (e := tier.scan_next()) is not None:  # examined by a demotion pass: books follow
        tier.scan_mark(e)
    tier.drop_shard(tier.entries[key(1)], 0)
    assert key(1) not in tier.entries and tier.alloc.used == 2 * SLOT
    check_invariants(tier)
    pinned = tier.entries[key(2)]
    tier.pin([pinned])
    tier.drop_shard(pinned, 0)
    assert tier.ready_prefix([key(2)], reader) == [] and tier.stats()["chunks"] == 1
    tier.unpin([pinned])
    check_invariants(tier)
    todo, deduped = store(tier, [2])
    assert [e for _, e in todo] == [pinned] and deduped == 0
    assert tier.ready_prefix([key(2)], reader) == [pinned]
    check_invariants(tier)


class Model:
    """The documented policy in the plainest form: a list in LRU order of evictable keys."""

    def __init__(self, slots: int):
        self.slots, self.order, self.state = slots, [], {}  # key -> [stored, writing, refs]

    def evictable(self, k) -> bool:
        return self.state[k][1] == 0 and self.state[k][2] == 0

    def use(self, k) -> None:
        if k in self.order:
            self.order.remove(k)
            self.order.append(k)

    def reserve(self, ks, rank):
        bit, fresh, joins, dedups = 1 << rank, [], [], []
        for k in dict.fromkeys(ks):
            if k not in self.state:
                fresh.append(k)
            elif (self.state[k][0] | self.state[k][1]) & bit:
                dedups.append(k)
            else:
                joins.append(k)
        held = [k for k in dedups + joins if k in self.order]
        free = self.slots - len(self.state)
        if fresh and len(fresh) > free + len(self.order) - len(held):
            return None
        for k in held:
            self.order.remove(k)
        for _ in range(len(fresh) - free):
            del self.state[self.order.pop(0)]
        for k in dedups:
            if self.evictable(k):
                self.order.append(k)
        for k in joins:
            self.state[k][1] |= bit
        for k in fresh:
            self.state[k] = [0, bit, 0]
        return sorted(joins + fresh, key=ks.index)

    def finish(self, k, rank, ok: bool) -> None:
        st = self.state[k]
        st[1] &= ~(1 << rank)
        if ok:
            st[0] |= 1 << rank
            self.use(k)
        elif st[0] == 0 and st[1] == 0:
            del self.state[k]
            return
        if self.evictable(k) and k not in self.order:
            self.order.append(k)

    def pin(self, k) -> None:
        self.state[k][2] += 1
        if k in self.order:
            self.order.remove(k)

    def unpin(self, k) -> None:
        self.state[k][2] -= 1
        if self.evictable(k):
            self.order.append(k)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_follow_the_model(seed):
    rng = random.Random(seed)
    slots, shards = 24, 2
    tier, model = HostTier(slots * SLOT, SLOT), Model(slots)
    inflight, pins = [], []  # (key, rank, entry); (key, entry)
    for _ in range(1500):
        op = rng.random()
        if op < 0.35:
            ks, rank = [key(rng.randrange(40)) for _ in range(rng.randrange(1, 6))], rng.randrange(2)
            expect = model.reserve(ks, rank)
            try:
                todo, _ = tier.reserve_many(ks, NS, SLOT // shards, shards, rank)
            except NoSpace:
                assert expect is None
            else:
                assert [e.key for _, e in todo] == expect
                inflight += [(e.key, rank, e) for _, e in todo]
        elif op < 0.55 and inflight:
            k, rank, e = inflight.pop(rng.randrange(len(inflight)))
            ok = rng.random() < 0.85
            if ok:
                tier.commit_many([e], rank)
            else:
                tier.abort(e, rank)
            model.finish(k, rank, ok)
        elif op < 0.7:
            ks = [key(rng.randrange(40)) for _ in range(rng.randrange(1, 4))]
            for e in tier.ready_prefix(ks, Scope(NS, shards, SLOT // shards)):
                model.use(e.key)
        elif op < 0.85:
            ready = [e for e in tier.entries.values() if e.ready]
            if ready:
                e = rng.choice(ready)
                tier.pin([e])
                model.pin(e.key)
                pins.append((e.key, e))
        elif pins:
            k, e = pins.pop(rng.randrange(len(pins)))
            tier.unpin([e])
            model.unpin(k)
        if rng.random() < 0.1 and tier.entries:
            tier.set_on_disk(rng.choice(list(tier.entries.values())), rng.random() < 0.7)
        if rng.random() < 0.2:  # demotion scan steps
            e = tier.scan_next()
            if e is not None:
                tier.scan_mark(e)
        assert [e.key for e in tier.lru] == model.order
        assert set(tier.entries) == set(model.state)
        check_invariants(tier)


@pytest.mark.parametrize("seed", range(4))
def test_random_demotion_pins_and_scans_keep_the_books(seed):
    rng = random.Random(100 + seed)
    tier = HostTier(32 * SLOT, SLOT)
    demoting = []  # (entry, clock when pinned)
    for step in range(2000):
        op = rng.random()
        if op < 0.3:
            try:
                store(tier, [rng.randrange(60) for _ in range(rng.randrange(1, 5))])
            except NoSpace:
                pass
        elif op < 0.45:
            e = tier.scan_next()
            if e is not None and e.ready and rng.random() < 0.5:
                demoting.append((e, tier.clock))
                tier.pin([e])
            elif e is not None:
                tier.scan_mark(e)
        elif op < 0.6 and demoting:
            e, since = demoting.pop(rng.randrange(min(3, len(demoting))))  # about in order
            tier.set_on_disk(e, True)
            tier.unpin([e], cold_since=since)
        elif op < 0.75:
            tier.ready_prefix([key(rng.randrange(60)) for _ in range(2)], Scope(NS, 1, SLOT))
        elif op < 0.8 and tier.entries:
            tier.set_on_disk(rng.choice(list(tier.entries.values())), False)
        elif op < 0.82:
            tier.clear()
        check_invariants(tier)
    for e, since in demoting:
        tier.unpin([e], cold_since=since)
    check_invariants(tier)
