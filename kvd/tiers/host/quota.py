"""Quotas: host and disk bytes per model and tenant, capped and reserved.

Each rule (kvd.quota_rules) is a group, a ``Bucket`` of usage and counters; unmatched chunks
count in ``other``. An entry's ``acct`` indexes one account per distinct rule set, so the
table grows with the config, never with labels clients send (labels are unverified:
accounting between cooperating engines). ``QuotaBook`` watches the host tier through the
index and queue it hands it: ``cap_victims`` evicts a group's own entries before it passes
``host_max`` (``OverQuota`` having changed nothing when it cannot), ``victims`` skips entries
another group reserves (``host_reserve``), ``reserved_bytes`` feeds the room check.
Disk: ``disk_admit`` deletes a group's oldest unread disk chunks before passing ``disk_max``,
else the chunk is not demoted. Event loop; ``stats()`` is safe from the metrics thread.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from itertools import islice

from kvd.tiers.host.lru import LruQueue
from kvd_protocol.errors import OverQuota

ANY = "*"          # the label of a rule's model or tenant left unnamed
OTHER = "(other)"  # the labels of the bucket of chunks no rule matches
DISK_TRIES = 8     # a group's oldest disk chunks one admission tries to delete, per round


class Bucket:
    """One group's limits (0: none), bytes and counters."""

    __slots__ = ("model", "tenant", "host_max", "host_reserve", "disk_max", "accounts",
                 "host_used", "host_evictable", "disk_used", "host_evictions", "host_refused",
                 "disk_evictions", "disk_refused")

    def __init__(self, rule=None):
        self.model, self.tenant = (OTHER, OTHER) if rule is None else \
            (rule.model or ANY, rule.tenant or ANY)
        self.host_max = getattr(rule, "host_max", 0)
        self.host_reserve = getattr(rule, "host_reserve", 0)
        self.disk_max = getattr(rule, "disk_max", 0)
        self.accounts: list[Account] = []
        self.host_used = self.host_evictable = self.disk_used = 0
        self.host_evictions = self.host_refused = self.disk_evictions = self.disk_refused = 0

    @property
    def name(self) -> str:
        return f"model {self.model} tenant {self.tenant}"

    def stats(self) -> dict:
        return {"model": self.model, "tenant": self.tenant, "host_max_bytes": self.host_max,
                "host_reserve_bytes": self.host_reserve, "disk_max_bytes": self.disk_max,
                "host_used_bytes": self.host_used, "host_evictable_bytes": self.host_evictable,
                "disk_used_bytes": self.disk_used, "host_evictions": self.host_evictions,
                "host_refused": self.host_refused, "disk_evictions": self.disk_evictions,
                "disk_refused": self.disk_refused}


class Account:
    __slots__ = ("buckets", "queue", "disk")

    def __init__(self, buckets: tuple):
        self.buckets = buckets
        self.queue: OrderedDict = OrderedDict()  # key -> evictable host Entry, LRU first
        self.disk: OrderedDict = OrderedDict()   # key -> (write number, file bytes), oldest first


class QuotaBook:
    def __init__(self, rules):
        self.buckets = tuple(Bucket(r) for r in rules)
        self.other = Bucket()
        self.accounts = [Account((self.other,))]
        self._by_rules = {(): 0}  # the rule indexes an account matches -> the account
        self._model = {r.model: i for i, r in enumerate(rules) if not r.tenant}
        self._tenant = {r.tenant: i for i, r in enumerate(rules) if not r.model}
        self._pair = {(r.model, r.tenant): i for i, r in enumerate(rules) if r.model and r.tenant}
        self.reserving = tuple(b for b in self.buckets if b.host_reserve)
        self.overlap = _overlap([r for r in rules if r.host_reserve])
        self.disk_of: dict[bytes, int] = {}  # key on disk (or being written) -> its account
        self.disk_writes = 0

    def account(self, model: str, tenant: str | None) -> int:
        """The account of chunks of ``model`` stored with label ``tenant`` (O(1))."""
        found = (self._model.get(model), self._tenant.get(tenant) if tenant else None,
                 self._pair.get((model, tenant)) if tenant else None)
        rules = tuple(sorted(i for i in found if i is not None))
        acct = self._by_rules.get(rules)
        if acct is None:
            acct = self._by_rules[rules] = len(self.accounts)
            account = Account(tuple(self.buckets[i] for i in rules))
            self.accounts.append(account)
            for b in account.buckets:
                b.accounts.append(account)
        return acct

    def index(self) -> dict:
        return _Index(self)

    def queue(self) -> LruQueue:
        return _Queue(self)

    # ---- host tier -------------------------------------------------------------------

    def host_bytes(self, e, sign: int) -> None:
        for b in self.accounts[e.acct].buckets:
            b.host_used += sign * e.slot_bytes

    def evicted(self, e, sign: int) -> None:
        """``e`` was evicted (sign -1: put back, the reservation failed after all)."""
        for b in self.accounts[e.acct].buckets:
            b.host_evictions += sign

    def queued(self, e, front: bool) -> None:
        queue = self.accounts[e.acct].queue
        queue[e.key] = e
        if front:  # a cold demoted entry, or an eviction undone: the account's LRU end
            queue.move_to_end(e.key, last=False)
        for b in self.accounts[e.acct].buckets:
            b.host_evictable += e.slot_bytes

    def unqueued(self, e) -> None:
        del self.accounts[e.acct].queue[e.key]
        for b in self.accounts[e.acct].buckets:
            b.host_evictable -= e.slot_bytes

    def cap_victims(self, acct: int, need: int) -> list:
        """The entries to evict so that ``need`` more bytes of ``acct`` stay within every
        ``host_max`` of its groups: each such group's own, least recently used first."""
        chosen: dict = {}
        for b in self.accounts[acct].buckets:
            if not b.host_max or b.host_used + need <= b.host_max:
                continue
            in_use = b.host_used - b.host_evictable
            if in_use + need > b.host_max:
                b.host_refused += 1
                raise OverQuota(f"the quota of {b.name} allows {b.host_max} bytes in the host tier; "
                                f"{in_use} are in use (leased, being loaded or written) and "
                                f"{need} more were asked for: nothing stored")
            over = b.host_used + need - b.host_max - sum(
                e.slot_bytes for e in chosen.values() if b in self.accounts[e.acct].buckets)
            for e in heapq.merge(*(a.queue.values() for a in b.accounts), key=_last_use):
                if over <= 0:
                    break
                if e.key not in chosen:
                    chosen[e.key] = e
                    over -= e.slot_bytes
        for e in chosen.values():
            self.evicted(e, +1)
        return list(chosen.values())

    def protects(self, e, acct: int) -> bool:
        """Evicting ``e`` for ``acct`` would take another group below its ``host_reserve``."""
        mine = self.accounts[acct].buckets
        return any(b.host_reserve and b not in mine and b.host_used - e.slot_bytes < b.host_reserve
                   for b in self.accounts[e.acct].buckets)

    def reserved_bytes(self, acct: int) -> int:
        mine = self.accounts[acct].buckets
        kept = [b.host_evictable - min(b.host_evictable, max(0, b.host_used - b.host_reserve))
                for b in self.reserving if b not in mine]
        # rules that can match one chunk both count its bytes: the largest alone is safe (a
        # room check that lets too much through ends in an undone reservation, never more)
        return max(kept, default=0) if self.overlap else sum(kept)

    # ---- disk tier -------------------------------------------------------------------

    def disk_admit(self, e, size: int, delete) -> bool:
        """Whether host entry ``e``'s chunk (``size`` bytes on disk) may be demoted within
        its groups' ``disk_max``, deleting their oldest written chunks to make room; if so it
        counts from now (the write is queued next)."""
        account = self.accounts[e.acct]
        for b in account.buckets:
            if b.disk_max and not self._disk_room(b, size, delete):
                b.disk_refused += 1
                return False
        self.disk_writes += 1
        account.disk[e.key] = (self.disk_writes, size)
        self.disk_of[e.key] = e.acct
        for b in account.buckets:
            b.disk_used += size
        return True

    def _disk_room(self, b: Bucket, size: int, delete) -> bool:
        """Whether ``size`` more bytes fit ``b``'s ``disk_max`` once its oldest deletable
        chunks are deleted (``delete`` forgets them here through ``disk_forget``)."""
        while b.disk_used + size > b.disk_max and size <= b.disk_max:
            oldest = sorted((number, key) for a in b.accounts
                            for key, (number, _) in islice(a.disk.items(), DISK_TRIES))
            deleted = False
            for _, key in oldest[:DISK_TRIES]:
                if b.disk_used + size <= b.disk_max:
                    break
                deleted = delete(key) or deleted
            if not deleted:
                break
        return b.disk_used + size <= b.disk_max

    def disk_touch(self, key: bytes) -> None:
        """``key`` was promoted back to the host tier: its file is the newest of its account."""
        acct = self.disk_of.get(key)
        if acct is not None:
            self.disk_writes += 1
            disk = self.accounts[acct].disk
            disk[key] = (self.disk_writes, disk[key][1])
            disk.move_to_end(key)

    def disk_forget(self, key: bytes, dropped: bool = True) -> None:
        """``key``'s file left the disk tier (``dropped``), or its write failed."""
        acct = self.disk_of.pop(key, None)
        if acct is None:
            return
        account = self.accounts[acct]
        _, size = account.disk.pop(key)
        for b in account.buckets:
            b.disk_used -= size
            b.disk_evictions += dropped

    def disk_account(self, key: bytes) -> int:
        return self.disk_of.get(key, 0)

    def stats(self) -> dict:
        return {"groups": [b.stats() for b in self.buckets], "other": self.other.stats()}


def _last_use(e) -> int:
    return e.used


def _overlap(rules: list) -> bool:
    """Whether two of ``rules`` can match one chunk (a model rule and a tenant rule, ...)."""
    def meet(a, b):
        return (not a.model or not b.model or a.model == b.model) and \
            (not a.tenant or not b.tenant or a.tenant == b.tenant)
    return any(meet(a, b) for i, a in enumerate(rules) for b in rules[i + 1:])


class _Index(dict):
    """The host tier's key -> Entry map, counting each entry's bytes in its groups."""

    __slots__ = ("book",)

    def __init__(self, book: QuotaBook):
        super().__init__()
        self.book = book

    def __setitem__(self, key, e) -> None:
        old = self.get(key)
        if old is not None:
            self.book.host_bytes(old, -1)
        super().__setitem__(key, e)
        self.book.host_bytes(e, +1)

    def __delitem__(self, key) -> None:
        self.book.host_bytes(self[key], -1)
        super().__delitem__(key)


class _Queue(LruQueue):
    """The host tier's evictable queue, mirrored per account; eviction by the quotas."""

    def __init__(self, book: QuotaBook):
        super().__init__()
        self.book = book

    def append(self, item) -> None:
        super().append(item)
        self.book.queued(item, front=False)

    def appendleft(self, item) -> None:
        super().appendleft(item)
        self.book.queued(item, front=True)

    def insert_after(self, item, anchor) -> None:
        super().insert_after(item, anchor)
        self.book.queued(item, front=True)  # the host tier's cold run: demoted, not used since

    def move_to_end(self, item) -> None:
        super().move_to_end(item)
        self.book.accounts[item.acct].queue.move_to_end(item.key)

    def remove(self, item) -> None:
        super().remove(item)
        self.book.unqueued(item)

    def victims(self, acct: int):
        book, passed = self.book, None  # passed: the last entry passed over (a reservation's)
        while True:
            e = self.first() if passed is None else self.after(passed)
            while e is not None and book.reserving and book.protects(e, acct):
                passed, e = e, self.after(e)
            if e is not None:
                book.evicted(e, +1)
            yield e

    def cap_victims(self, acct: int, need: int) -> list:
        return self.book.cap_victims(acct, need)

    def reserved_bytes(self, acct: int) -> int:
        return self.book.reserved_bytes(acct)

    def evicted(self, item, sign: int) -> None:
        self.book.evicted(item, sign)
