"""A driver thread for one GPU's DMA copies of one direction: the event loop plans, the thread queues.

Why: a pool with one allocation per layer (SGLang's) is copied one row per
(layer, page): 1,952 rows for a DeepSeek-MLA request of 8 chunks of 256
tokens at pages of 64, and ``cuMemcpyBatchAsync`` costs the calling thread
0.55-1.1 us a row on an H100 host (docs/benchmarks.md in git history). On the event loop
that is 1-2 ms a copy, while the copy itself takes ~3 ms of PCIe, and the
loop also serves requests and completions: both ways at once it saturates.
The driver call releases the GIL (ctypes), so a thread of its own runs it
beside the loop.

Contract:

- ``DmaHand(cp, ordinal, queue, name)``: a thread (started on first use)
  that owns the enqueueing of ``queue`` (a ``kvd.cuda.dma.queue.DmaQueue``, one
  direction): once a copy is handed here, everything queued on that queue's
  streams goes through this thread, in the order handed.
- ``hand(work, then=None) -> Handed``: runs ``work()`` (it queues a copy's
  steps on ``queue``) and then ``then()`` (e.g. a load's done word) on the
  thread, and returns at once, without waiting for the thread. ``Handed``
  has the poller's ``done``: False until the thread ran both and recorded
  an event behind them on ``queue.stream``, and that event completed; then
  True, or the error ``work`` or ``then`` raised. After an error in
  ``work``, the thread joins every stream of the queue before ``then`` and
  the event, so the caller never frees arena chunks, nor the engine reuses
  pages, that a queued copy still touches.
- The thread takes the device's primary context first (the driver refuses
  batches from a thread without one). While it runs, the interpreter's
  switch interval is ``SWITCH_S``: the loop, always busy while copies run,
  held the GIL for up to the default 5 ms before the thread got it back
  after a driver call (median 0.56 ms, measured in the fourth session of
  2026-11-27), which left copies waiting on the hand-off.
- Should the thread fail to take the context, every copy handed to it fails
  with that error (nothing was queued), instead of never landing.
- ``close(timeout)`` lets the thread finish what it was handed and joins
  it for at most ``timeout`` seconds (call before synchronizing the queue's
  streams at shutdown); False if the thread is still in a driver call or
  waiting for its queue then (the caller frees nothing a queued copy may
  use). The switch interval is restored once no GPU's thread runs.
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
