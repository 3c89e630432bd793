"""A driver thread for one GPU's DMA copies of one direction: the event loop plans, the thread queues.

Why: per-row driver calls (0.55-1.1 us each, ~2k rows a request for per-layer pools)
saturate the loop; ctypes releases the GIL, so a thread runs them beside it.
``DmaHand(cp, ordinal, queue, name)`` owns enqueueing on ``queue``'s streams once used;
``hand(work, then)`` returns a ``Handed`` whose ``done`` turns true (or the error) once the
thread ran both and its event completed. After an error the thread joins the queue's
streams first, so no arena chunk or engine page is freed under a queued copy. A thread
that cannot take the device context fails every handed copy. ``close(timeout)`` joins it.
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any, Callable

from kvd_protocol import cuda_driver

SWITCH_S = 0.0002
_lock = threading.Lock()
_switch = {"threads": 0, "before": 0.0}  # GPUs' threads running; the interval before them


class Handed:
    """A copy in the thread's hands (module doc): ``done`` for the poller."""
    __slots__ = ("event", "error")

    def __init__(self) -> None:
        self.event: Any = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        event = self.event  # set after error: once seen, error is final
        if event is None or not event.done:
            return False
        if self.error is not None:
            raise self.error
        return True


class _Landed:
    done = True


class DmaHand:
    """One queue's driver thread (module doc)."""

    def __init__(self, cp: Any, ordinal: int, queue_: Any, name: str) -> None:
        self.cp, self.ordinal, self.queue, self.name = cp, ordinal, queue_, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def hand(self, work: Callable[[], Any], then: Callable[[], Any] | None = None) -> Handed:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            with _lock:
                if not _switch["threads"]:
                    _switch["before"] = sys.getswitchinterval()
                    sys.setswitchinterval(SWITCH_S)
                _switch["threads"] += 1
            self._thread.start()
        handed = Handed()
        self._jobs.put((work, then, handed))
        return handed

    def _work(self) -> None:
        try:
            self.cp.cuda.Device(self.ordinal).use()
            cuda_driver.ensure_context(self.ordinal)
        except Exception as exc:  # noqa: BLE001 - every copy handed here fails with it
            while (job := self._jobs.get()) is not None:
                job[2].error, job[2].event = exc, _Landed()
            return
        while (job := self._jobs.get()) is not None:
            self._queue(*job)

    def _queue(self, work: Callable[[], Any], then: Callable[[], Any] | None,
               handed: Handed) -> None:
        error = None
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - crosses to the caller through Handed
            error = exc
        try:
            if error is not None:
                self.queue.join_streams()
            if then is not None:
                then()
            event = self.cp.cuda.Event(block=False, disable_timing=True)
            event.record(self.queue.stream)
        except Exception as exc:  # noqa: BLE001 - a broken context: nothing queued will land
            error, event = error or exc, _Landed()
        handed.error = error
        handed.event = event

    def close(self, timeout: float | None = None) -> bool:
        if self._thread is None:
            return True
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._thread = None
        with _lock:
            _switch["threads"] -= 1
            if not _switch["threads"]:
                sys.setswitchinterval(_switch["before"])
        return True
