"""Quotas in the host tier (kvd.tiers.host.quota composed into kvd.tiers.host.tier): a capped group
evicts only its own entries, a reservation holds against other groups' stores, a refusal
changes nothing, an undone reservation puts every group's counters back, and the book's
counters always match a brute-force look at the entries (random operations too)."""

from __future__ import annotations

import random

import pytest

from kvd.quota_rules import Quota
from kvd.tiers.host.quota import QuotaBook
from kvd.tiers.host.tier import HostTier
from kvd_protocol.errors import BadRequest, NoSpace, OverQuota

SLOT = 256
NS = b"n" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def tier_with(*rules, slots: int = 16):
    book = QuotaBook(rules)
    return HostTier(slots * SLOT, SLOT, book), book


def store(tier: HostTier, ids, acct: int, size: int = SLOT) -> None:
    todo, _ = tier.reserve_many([key(i) for i in ids], NS, size, 1, 0, acct)
    tier.commit_many([e for _, e in todo], 0)


def held(tier: HostTier) -> list[int]:
    return sorted(int.from_bytes(k, "little") for k in tier.entries)


def entries(tier: HostTier, ids) -> list:
    return [tier.entries[key(i)] for i in ids]


def check_book(tier: HostTier, book: QuotaBook) -> None:
    """Every group's bytes, evictable bytes and per-account queue agree with the entries."""
    for b in (*book.buckets, book.other):
        mine = [e for e in tier.entries.values() if b in book.accounts[e.acct].buckets]
        assert b.host_used == sum(e.slot_bytes for e in mine)
        assert b.host_evictable == sum(e.slot_bytes for e in mine if tier.lru.queued(e))
        assert not b.host_max or b.host_used <= b.host_max
    for i, account in enumerate(book.accounts):  # (its order: the global one, roughly)
        assert set(account.queue) == {e.key for e in tier.lru if e.acct == i}
    assert sum(len(a.queue) for a in book.accounts) == len(tier.lru)


def test_a_capped_group_evicts_only_its_own_least_recently_used():
    tier, book = tier_with(Quota(tenant="a", host_max=4 * SLOT))
    a, b = book.account("m", "a"), book.account("m", "b")
    assert (a, b) == (1, 0) and book.account("other-model", "a") != b
    store(tier, [0, 1, 2, 3], a)
    store(tier, [10, 11, 12, 13], b)
    tier.touch(entries(tier, [0]))  # 0 is used again: 1 is a's oldest now
    store(tier, [4, 5], a)  # the tier has room; the cap does not
    assert held(tier) == [0, 3, 4, 5, 10, 11, 12, 13]
    group = book.buckets[0]
    assert group.host_used == 4 * SLOT and group.host_evictions == 2
    assert book.other.host_evictions == 0 and tier.stats()["evictions"] == 2
    check_book(tier, book)


def test_a_group_whose_chunks_are_in_use_is_refused_and_nothing_changes():
    tier, book = tier_with(Quota(model="m", host_max=3 * SLOT))
    a, b = book.account("m", None), book.account("n", None)
    store(tier, [0, 1, 2], a)
    tier.pin(entries(tier, [0, 1, 2]))  # leased or being loaded
    before = (held(tier), tier.stats(), book.buckets[0].stats())
    with pytest.raises(OverQuota, match="model m tenant \\*"):
        store(tier, [3], a)
    assert isinstance(OverQuota("x"), NoSpace) and OverQuota.code == "over_quota"
    assert (held(tier), tier.stats()) == before[:2]
    assert book.buckets[0].host_refused == 1
    store(tier, [0, 1], a)  # cached already: no new bytes, no refusal
    store(tier, [20, 21], b)  # another group: untouched by the cap
    tier.unpin(entries(tier, [0, 1, 2]))
    store(tier, [3], a)
    assert held(tier) == [1, 2, 3, 20, 21]
    check_book(tier, book)


def test_a_reservation_holds_against_other_groups_but_not_its_own():
    tier, book = tier_with(Quota(tenant="b", host_reserve=3 * SLOT), slots=8)
    b, other = book.account("m", "b"), book.account("m", None)
    store(tier, [0, 1, 2, 3], b)  # one slot above the reservation
    store(tier, [10, 11, 12, 13], other)  # the tier is full
    store(tier, [20, 21, 22], other)  # evicts 0 (b keeps its 3), then its own 10 and 11
    assert held(tier) == [1, 2, 3, 12, 13, 20, 21, 22]
    assert book.buckets[0].host_evictions == 1 and book.other.host_evictions == 2
    before = held(tier)
    with pytest.raises(NoSpace, match="reserved"):  # 5 evictable for it, 3 kept for b
        store(tier, [30, 31, 32, 33, 34, 35], other)
    assert held(tier) == before and book.other.host_evictions == 2
    store(tier, [40, 41, 42, 43], b)  # b itself may go below its reservation
    assert held(tier) == [13, 20, 21, 22, 40, 41, 42, 43]
    check_book(tier, book)


def test_groups_that_overlap_each_keep_their_own_cap():
    tier, book = tier_with(Quota(model="m", host_max=6 * SLOT), Quota(tenant="a", host_max=2 * SLOT))
    ma, mb, na = book.account("m", "a"), book.account("m", "b"), book.account("n", "a")
    assert len({ma, mb, na}) == 3 and len(book.accounts) == 4
    store(tier, [0, 1], ma)
    store(tier, [2, 3, 4, 5], mb)  # the model's cap reached
    store(tier, [6], ma)  # tenant a over its cap: a's oldest (0) goes, the model stays at 6
    assert held(tier) == [1, 2, 3, 4, 5, 6]
    store(tier, [7], mb)  # the model over its cap: the model's oldest (1, of tenant a) goes
    assert held(tier) == [2, 3, 4, 5, 6, 7]
    store(tier, [8, 9], na)  # tenant a of another model: its cap counts 6 too -> 6 goes
    assert held(tier) == [2, 3, 4, 5, 7, 8, 9]
    assert [g.host_used for g in book.buckets] == [5 * SLOT, 2 * SLOT]
    check_book(tier, book)


def test_an_undone_reservation_puts_back_the_groups_evictions_too():
    tier, book = tier_with(Quota(tenant="a", host_max=3 * SLOT), slots=4)
    a, other = book.account("m", "a"), book.account("m", None)
    store(tier, [0, 1, 2], a)  # slots 0, 1, 2
    store(tier, [3], other)  # slot 3
    tier.pin(entries(tier, [1, 3]))
    before = ([(e.key, e.offset) for e in tier.lru], tier.stats(), book.buckets[0].stats())
    # the cap evicts 0 and 2 (a's evictable ones): two free slots, but not adjacent
    with pytest.raises(NoSpace, match="fragmented"):
        store(tier, [9], a, size=2 * SLOT)
    assert ([(e.key, e.offset) for e in tier.lru], tier.stats(), book.buckets[0].stats()) == before
    check_book(tier, book)


def test_the_book_matches_the_entries_under_random_operations():
    rules = (Quota(model="m", host_max=10 * SLOT), Quota(tenant="a", host_max=4 * SLOT,
                                                          host_reserve=2 * SLOT),
             Quota(model="m", tenant="b", host_reserve=3 * SLOT))
    tier, book = tier_with(*rules, slots=16)
    accounts = [book.account(m, t) for m in ("m", "n") for t in ("a", "b", None)]
    rng, pinned, next_id = random.Random(42), [], 0
    for step in range(600):
        op = rng.random()
        if op < 0.6:
            n = rng.randint(1, 4)
            ids = [rng.randrange(next_id) for _ in range(rng.randint(0, 2)) if next_id] + \
                list(range(next_id, next_id + n))
            next_id += n
            try:
                store(tier, ids, rng.choice(accounts), size=rng.choice((SLOT, SLOT, 2 * SLOT)))
            except (NoSpace, BadRequest):  # full, or a key cached at another size: no change
                pass
        elif op < 0.75 and tier.entries:
            e = rng.choice(list(tier.entries.values()))
            tier.pin([e])
            pinned.append(e)
        elif op < 0.9 and pinned:
            tier.unpin([pinned.pop(rng.randrange(len(pinned)))])
        elif tier.entries:
            tier.touch([rng.choice(list(tier.entries.values()))])
        check_book(tier, book)
    assert sum(b.host_evictions for b in book.buckets) > 20
    assert sum(b.host_refused for b in book.buckets) > 0


def test_a_disk_cap_deletes_the_groups_oldest_deletable_chunks_or_refuses():
    book = QuotaBook((Quota(tenant="a", disk_max=2 * 8192),))
    a, b = book.account("m", "a"), book.account("m", "b")
    e = [type("E", (), {"key": key(i), "acct": a if i < 6 else b})() for i in range(7)]
    kept, deleted = {key(1)}, []  # kept: being read, or its chunk is in the host tier

    def delete(k: bytes) -> bool:  # the disk tier forgets a deleted file (on_evict)
        if k in kept:
            return False
        deleted.append(k)
        book.disk_forget(k)
        return True
    assert book.disk_admit(e[0], 8192, delete) and book.disk_admit(e[1], 8192, delete)
    assert book.disk_admit(e[2], 8192, delete) and deleted == [key(0)]
    assert book.disk_admit(e[3], 8192, delete) and deleted == [key(0), key(2)]  # 1 is kept
    assert book.disk_admit(e[6], 8192, delete)  # another group: no cap
    kept.add(key(3))
    assert not book.disk_admit(e[4], 8192, delete)  # 1 and 3: nothing may go
    assert not book.disk_admit(e[4], 3 * 8192, delete)  # larger than the cap itself
    group = book.buckets[0]
    assert (group.disk_used, group.disk_evictions, group.disk_refused) == (2 * 8192, 2, 2)
    kept.discard(key(3))
    book.disk_touch(key(1))  # promoted: the newest now, so 3 goes first
    kept.discard(key(1))
    assert book.disk_admit(e[5], 8192, delete) and deleted[-1] == key(3)
    assert book.disk_account(key(5)) == a and book.disk_account(key(0)) == 0
    book.disk_forget(key(5), dropped=False)  # its write failed
    assert (group.disk_used, group.disk_evictions) == (8192, 3)
    assert book.other.disk_used == 8192 and book.disk_account(key(6)) == b == 0
