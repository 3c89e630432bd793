"""Who may queue a copy in a backend now: a fair share per queue, a little more while alone.

A backend runs the copies of one queue in the order they were queued (the
CUDA backend: one queue per GPU and direction, ``CudaCopyEngine.queue_of``).
A client with many requests in flight must not put many copies ahead of
another client's; but with only one copy of its own queued at a time, the
copy engines idle while the daemon notices that copy landed and queues the
next: 1.35 ms (store) and 2.0 ms (load) per 268 MB copy on an H100 host,
30-39% of the time when one client stores while another loads, each alone
in its direction (daemon debug log, docs/benchmarks.md in git history).

Contract:

- ``CopyGate(fair, alone, alone_bytes)``. ``await enter(session, queue,
  nbytes)`` returns once ``session`` may queue one more copy of ``nbytes``
  in ``queue``, and counts it: while another session has a copy queued or
  waiting in that queue, when it has fewer than ``fair`` queued there; while
  alone, when it has fewer than ``alone`` queued, or when its queued bytes
  plus ``nbytes`` (not 0) are at most ``alone_bytes`` (0, the default: never;
  meant for small copies, 144 MB for 128 chunks of DeepSeek-MLA, of which two
  leave the daemon little time to queue the next, docs/benchmarks.md in git history).
  ``leave(session, queue, nbytes)`` when the copy landed, failed, or was
  never queued. A waiter that is cancelled leaves no trace.
- ``queue`` None (the host backend: its copies run on a thread pool that
  every client shares, and queuing ahead gains nothing) is one queue per
  session across all its copies, limit ``fair``.
- So another client's copy waits behind at most ``alone`` copies of a
  session queued before it arrived, or more of at most ``alone_bytes`` in
  all, and once it is waiting, the session queues no more than ``fair``.
- Every ``leave`` and every cancelled waiter wakes the waiters, which
  re-check their limit; nothing here blocks the event loop. Each waiter
  waits on a future of its own, so a ``leave`` lets a waiter in on the next
  loop turn (a future shared behind ``asyncio.shield`` took two, and each
  turn may wait behind another request's work). ``total`` is
  the copies queued now (``kvd stats`` ``copies_queued``, the
  ``kvd_copies_queued`` gauge), ``queued_by(session)`` one client's;
  ``idle`` (an ``Idle`` event, for other threads: the journal's hashing) is
  set while ``total`` is 0, with the time it was last set.
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
