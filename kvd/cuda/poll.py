"""Completion of CUDA work observed by polling its events from the event loop.

``EventPoller.wait(event)`` returns an asyncio future that resolves (result
None) once ``event`` (a CuPy event, recorded after the work) has completed.
While any future is pending, the loop re-checks every pending event once
per iteration (``cudaEventQuery``, about a microsecond each) instead of
sleeping; when none is pending it sleeps in epoll as usual.

Why: waiting in a helper thread on a blocking-sync event costs two OS
wake-ups per copy (the thread, then the loop through its self-pipe), about
0.2-0.3 ms on the virtualized hosts we measured (tools/request_breakdown.py),
which is 4-5% of a 268 MB copy. Polling also keeps the loop awake for the
replies and requests that follow. Each idle pass yields the GIL
(``time.sleep(0)``) so IO threads are never starved by the polling loop.
A failed query (a CUDA error) fails that future; other futures go on.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


class EventPoller:
    def __init__(self) -> None:
        self.pending: list[tuple[Any, asyncio.Future]] = []
        self._scheduled = False

    def wait(self, event: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.pending.append((event, fut))
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
        if not progressed:
            time.sleep(0)  # let IO threads take the GIL between passes
        loop.call_soon(self._poll, loop)
