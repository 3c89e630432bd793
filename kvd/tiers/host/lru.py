"""An intrusive doubly linked LRU queue: O(1) append, insertion, and removal from the middle.

Holds only the host tier's evictable entries, least recently used first (as vLLM's free-block
queue), so eviction pops the head. Items carry their own links (``lru_prev``/``lru_next``):
no node allocations, membership is an attribute test, one queue per item. Removing the
item just yielded while iterating is allowed. Answers the eviction questions plainly
(``victims``: LRU order; ``cap_victims``/``reserved_bytes``: none); kvd.tiers.host.quota's
queue answers them by the configured quotas.
"""

from __future__ import annotations


class _Head:
    """The sentinel: ``lru_next`` is the least recently used item, ``lru_prev`` the most."""

    __slots__ = ("lru_prev", "lru_next")


class LruQueue:
    def __init__(self) -> None:
        self._head = _Head()
        self._head.lru_prev = self._head.lru_next = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @staticmethod
    def queued(item) -> bool:
        return item.lru_next is not None

    def append(self, item) -> None:
        """Put ``item`` at the most recently used end."""
        self._link(item, self._head.lru_prev, self._head)

    def appendleft(self, item) -> None:
        """Put ``item`` at the least recently used end (the next to be evicted)."""
        self._link(item, self._head, self._head.lru_next)

    def insert_after(self, item, anchor) -> None:
        """Put ``item`` just after ``anchor`` (a queued item), on its more recently used side."""
        self._link(item, anchor, anchor.lru_next)

    def _link(self, item, prev, nxt) -> None:
        if item.lru_next is not None:
            raise ValueError("item is already queued")
        item.lru_prev, item.lru_next = prev, nxt
        prev.lru_next = nxt.lru_prev = item
        self._len += 1

    def move_to_end(self, item) -> None:
        """Make queued ``item`` the most recently used."""
        head = self._head
        if head.lru_prev is item:
            return
        prev, nxt = item.lru_prev, item.lru_next
        prev.lru_next, nxt.lru_prev = nxt, prev
        last = head.lru_prev
        item.lru_prev, item.lru_next = last, head
        last.lru_next = head.lru_prev = item

    def remove(self, item) -> None:
        prev, nxt = item.lru_prev, item.lru_next
        prev.lru_next, nxt.lru_prev = nxt, prev
        item.lru_prev = item.lru_next = None
        self._len -= 1

    def first(self):
        """The least recently used item, or None."""
        item = self._head.lru_next
        return None if item is self._head else item

    def after(self, item):
        """The item queued just after ``item`` (more recently used), or None."""
        nxt = item.lru_next
        return None if nxt is self._head else nxt

    def before(self, item):
        """The item queued just before ``item`` (less recently used), or None."""
        prev = item.lru_prev
        return None if prev is self._head else prev

    def __iter__(self):
        item = self._head.lru_next
        while item is not self._head:
            nxt = item.lru_next
            yield item
            item = nxt

    # ---- eviction policy: plain LRU (kvd/tiers/host/quota.py's queue applies quotas) ----------

    def victims(self, acct: int):
        """The entries one reservation of account ``acct`` evicts, as it asks for them (None:
        nothing left): here the least recently used, each time."""
        while True:
            yield self.first()

    def cap_victims(self, acct: int, need: int) -> tuple:
        """Entries to evict before ``need`` bytes of account ``acct`` are allocated."""
        return ()

    def reserved_bytes(self, acct: int) -> int:
        """Queued bytes eviction for account ``acct`` may not take."""
        return 0

    def evicted(self, item, sign: int) -> None:
        """An eviction of ``item`` was undone (``sign`` -1)."""
