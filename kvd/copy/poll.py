"""Completion observed by polling from the event loop: CUDA events and flag words.

``EventPoller.wait(event)`` returns an asyncio future that resolves (result
None) once ``event.done`` is true: a CuPy event recorded after a copy, or a
word of a flag page reaching a sequence number (kvd.copy.flags). While any
future is pending the loop re-checks every pending object once per
iteration instead of sleeping; when none is pending it sleeps in epoll as
usual. With ``idle_after_s`` set, a poller that has seen no progress for
that long re-checks every ``idle_sleep_s`` instead of every iteration: for
waits that can last a forward pass (a store waiting for the engine's
stream), where spinning would burn a core for nothing.

Why poll: waiting in a helper thread on a blocking-sync event costs two OS
wake-ups per copy (the thread, then the loop through its self-pipe), about
0.2-0.3 ms on the virtualized hosts we measured (tools/probes/request_breakdown.py),
which is 4-5% of a 268 MB copy. Each idle pass yields the GIL
(``time.sleep(0)``) so IO threads are never starved by the polling loop.
A failed check (a CUDA error) fails that future; other futures go on. A
future cancelled by its waiter is dropped at the next pass.
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
