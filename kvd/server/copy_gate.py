"""Who may queue a copy in a backend now: a fair share per queue, a little more while alone.

Why: one copy at a time leaves the copy engines idle while the daemon notices it landed
(30-39% of the time, one client per direction); many copies queued by one client delay
another's. ``CopyGate(fair, alone, alone_bytes)``: ``await enter(session, queue, nbytes)``
admits a copy while the session has fewer than ``fair`` queued (``alone`` or
``alone_bytes`` while no other session waits there); ``leave`` when it landed, failed or
was never queued. ``queue`` None (host backend) is one queue per session. Cancelled waiters
leave no trace; nothing blocks the loop. ``total``/``queued_by`` feed stats; ``idle`` is
set while nothing is queued (for the journal's hashing thread).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, defaultdict
from typing import Any, Hashable


class Idle(threading.Event):
    """Set while no copy is queued; ``since``: when it was last set (``time.monotonic``)."""

    def __init__(self) -> None:
        super().__init__()
        self.set()

    def set(self) -> None:
        self.since = time.monotonic()  # before the flag: a reader that sees it set sees this
        super().set()


class CopyGate:
    """Copies queued per (queue, session), with the limits of the module doc."""

    def __init__(self, fair: int, alone: int, alone_bytes: int = 0) -> None:
        self.fair, self.alone, self.alone_bytes = fair, max(fair, alone), alone_bytes
        self.queued: defaultdict[Hashable, Counter] = defaultdict(Counter)
        self.queued_bytes: defaultdict[Hashable, Counter] = defaultdict(Counter)
        self.waiting: defaultdict[Hashable, Counter] = defaultdict(Counter)
        self._wakes: list[asyncio.Future] = []  # one per waiter: a cancel cancels only its own
        self.total = 0  # copies queued now, all sessions (an int: safe to read from any thread)
        self.idle = Idle()  # set while total is 0

    def may_queue(self, session: Any, queue: Hashable | None, nbytes: int) -> bool:
        """Whether ``session`` may queue a copy of ``nbytes`` in ``queue`` now."""
        key = self._key(session, queue)
        count = self.queued.get(key, {}).get(session, 0)
        others = queue is None or any(s is not session for table in (self.queued, self.waiting)
                                      for s in table.get(queue, ()))
        if others:
            return count < self.fair
        held = self.queued_bytes.get(key, {}).get(session, 0)
        return count < self.alone or 0 < nbytes <= self.alone_bytes - held

    async def enter(self, session: Any, queue: Hashable | None, nbytes: int = 0) -> None:
        key = self._key(session, queue)
        self.waiting[key][session] += 1
        try:
            while not self.may_queue(session, queue, nbytes):
                wake = asyncio.get_running_loop().create_future()
                self._wakes.append(wake)
                await wake  # not a shared future behind a shield: one loop turn fewer
        except BaseException:
            self._drop(self.waiting, key, session)
            self._notify()  # one waiter fewer: another session's limit may have grown
            raise
        self._drop(self.waiting, key, session)
        self.queued[key][session] += 1
        self.queued_bytes[key][session] += nbytes
        self.total += 1
        if self.total == 1:
            self.idle.clear()

    def leave(self, session: Any, queue: Hashable | None, nbytes: int = 0) -> None:
        key = self._key(session, queue)
        self._drop(self.queued, key, session)
        held = self.queued_bytes[key]
        held[session] -= nbytes
        if session not in self.queued.get(key, ()):
            del held[session]
        if not held:
            del self.queued_bytes[key]
        self.total -= 1
        if not self.total:
            self.idle.set()
        self._notify()

    def queued_by(self, session: Any) -> int:
        """Copies of ``session`` queued in backends now (event-loop thread only)."""
        return sum(c.get(session, 0) for c in self.queued.values())

    @staticmethod
    def _key(session: Any, queue: Hashable | None) -> Hashable:
        return ("own queue", session) if queue is None else queue

    def _drop(self, table: defaultdict, key: Hashable, session: Any) -> None:
        counts = table[key]
        counts[session] -= 1
        if counts[session] <= 0:
            del counts[session]
        if not counts:
            del table[key]

    def _notify(self) -> None:
        wakes, self._wakes = self._wakes, []
        for wake in wakes:
            if not wake.done():
                wake.set_result(None)
