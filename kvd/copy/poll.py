"""Completion observed by polling from the event loop: CUDA events and flag words.

``EventPoller.wait(obj)`` returns an asyncio future that resolves once ``obj.done`` is true
(a CuPy event, or a flag word reaching a seq). While any future is pending the loop
re-checks once per iteration (yielding the GIL); with ``idle_after_s`` it backs off to
``idle_sleep_s`` after no progress; idle, it sleeps in epoll. Why poll: a helper thread
costs two OS wake-ups per copy (0.2-0.3 ms, 4-5% of a 268 MB copy; measured by
tools/probes/request_breakdown.py at commit ef6bcf2). A failed check fails only
that future; a cancelled future is dropped at the next pass.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


class EventPoller:
    def __init__(self, idle_after_s: float | None = None, idle_sleep_s: float = 0.0002) -> None:
        self.pending: list[tuple[Any, asyncio.Future]] = []
        self.idle_after_s = idle_after_s
        self.idle_sleep_s = idle_sleep_s
        self._scheduled = False
        self._last_progress = 0.0

    def wait(self, event: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.pending.append((event, fut))
        self._last_progress = time.monotonic()
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._poll, loop)
        return fut

    def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        still, progressed = [], False
        for event, fut in self.pending:
            if fut.done():  # cancelled by its waiter
                continue
            try:
                done = event.done
            except Exception as exc:  # noqa: BLE001 - a CUDA error fails this copy only
                fut.set_exception(exc)
                continue
            if done:
                fut.set_result(None)
                progressed = True
            else:
                still.append((event, fut))
        self.pending = still
        if not still:
            self._scheduled = False
            return
        now = time.monotonic()
        if progressed:
            self._last_progress = now
        elif self.idle_after_s is not None and now - self._last_progress > self.idle_after_s:
            loop.call_later(self.idle_sleep_s, self._poll, loop)
            return
        else:
            time.sleep(0)  # let IO threads take the GIL between passes
        loop.call_soon(self._poll, loop)
