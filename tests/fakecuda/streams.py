"""Fake CUDA streams and events: queued work that really runs later, in order, elsewhere.

A ``Stream`` owns a worker thread that runs its queued operations one at a
time in queue order, so everything kvd relies on is real: enqueueing
returns at once, work on one stream is ordered, two streams run
concurrently, an ``Event`` completes when the worker reaches it (``done``,
polled from kvd's event loop, or ``synchronize``), ``wait_event`` holds a
stream's worker until the event's latest record (at the time of the wait)
completed, and ``wait_value32`` holds it until a 32-bit word reaches a
value (cyclic GEQ, as ``cuStreamWaitValue32``), whoever writes the word: a
CPU or another stream. ``write_value32`` writes a word once the stream's
earlier work ran. Handles: ``ptr`` is a nonzero integer (``cudaStream_t``);
``stream_at(0)`` is the process's default stream; events created through
the runtime API get integer handles (``event_at``).

A fault in an operation (fakecuda.errors) breaks the context: later
operations that touch memory are skipped, events still complete (so no
waiter hangs) but ``done`` and ``synchronize`` raise the error.

Test knob: ``FAKECUDA_KERNEL_DELAY_S`` in the environment, seconds (every
kernel) or ``name=seconds`` pairs (``kv_scatter=2,kv_gather=0.1``; default
none): how long each kernel occupies its stream before it starts
(``kernel_delay(name)``; it reads its cancel word after the delay, as a
kernel queued behind busy SMs would), so a test can hold copies in flight
or a stream stuck. Worker threads
are daemon threads: a process may exit with work still queued, as a real
one may with a GPU still busy.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable

from . import errors, trace
from .errors import INVALID_HANDLE, CudaError
from .memory import SPACE

_changed = threading.Condition()          # notified whenever any operation completes
_streams: dict[int, "Stream"] = {}
_events: dict[int, "Event"] = {}
_ids = itertools.count(0x7F0000001000, 0x1000)
_registry_lock = threading.Lock()


class Stream:
    def __init__(self, non_blocking: bool = False, name: str = "") -> None:
        self.ptr = next(_ids)
        self.name = name or f"stream-{self.ptr:#x}"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0
        self._ran = 0
        self._thread = threading.Thread(target=self._work, name=f"fakecuda-{self.name}",
                                        daemon=True)
        self._thread.start()
        with _registry_lock:
            _streams[self.ptr] = self

    # ---- queueing -------------------------------------------------------------

    def enqueue(self, op: Callable[[], None], touches_memory: bool = True) -> None:
        """Queue ``op``; it runs on this stream's worker after everything queued before."""
        errors.check()
        self._queued += 1
        self._queue.put((op, touches_memory))

    def launch(self, fn: Callable[[], None]) -> None:
        """Queue arbitrary Python as GPU work (an engine's forward pass, a snapshot)."""
        self.enqueue(fn)

    def sleep(self, seconds: float) -> None:
        """Queue a busy period (torch.cuda._sleep)."""
        self.enqueue(lambda: _sleep(seconds), touches_memory=False)

    def wait_event(self, event: "Event") -> None:
        target = event.recorded
        if target:
            self.enqueue(lambda: event.wait_for(target), touches_memory=False)

    def write_value32(self, addr: int, value: int) -> None:
        self.enqueue(lambda: _write32(addr, value))

    def wait_value32(self, addr: int, value: int) -> None:
        SPACE.resolve(addr, 4, what="stream wait")  # checked at enqueue, as the driver does
        self.enqueue(lambda: _wait32(addr, value), touches_memory=False)

    # ---- completion -----------------------------------------------------------

    def __enter__(self) -> "Stream":
        self._outer = getattr(_local, "stream", None)
        _local.stream = self
        return self

    def __exit__(self, *exc) -> None:
        _local.stream = self._outer

    def synchronize(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far ran (False: ``timeout`` passed first)."""
        target = self._queued
        with _changed:
            ran = _changed.wait_for(lambda: self._ran >= target, timeout)
        errors.check()
        return ran

    @property
    def done(self) -> bool:
        errors.check()
        return self._ran >= self._queued

    def _work(self) -> None:
        while True:
            op, touches = self._queue.get()
            try:
                if not (touches and errors.broken()):
                    op()
            except CudaError as exc:
                trace.emit("error", stream=self.name, what=str(exc))
                errors.fail(exc)
            except Exception as exc:
                trace.emit("error", stream=self.name, what=repr(exc))
                errors.fail(CudaError(errors.ILLEGAL_ADDRESS, f"queued work raised {exc!r}"))
            with _changed:
                self._ran += 1
                _changed.notify_all()


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self.recorded = 0     # records queued so far
        self.completed = 0    # the highest record a stream reached
        self.when = None      # time.monotonic() when it last completed (get_elapsed_time)
        self.handle = next(_ids)

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        self.recorded += 1
        target = self.recorded
        stream.enqueue(lambda: self._complete(target), touches_memory=False)

    def _complete(self, target: int) -> None:
        self.when = time.monotonic()
        self.completed = max(self.completed, target)

    def wait_for(self, target: int) -> None:
        with _changed:
            _changed.wait_for(lambda: self.completed >= target)

    @property
    def done(self) -> bool:
        errors.check()
        return self.completed >= self.recorded

    def synchronize(self) -> None:
        self.wait_for(self.recorded)
        errors.check()


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two completed events (``cupy.cuda.get_elapsed_time``)."""
    if start.when is None or end.when is None or not (start.done and end.done):
        raise CudaError(errors.NOT_READY, "get_elapsed_time of an event not completed")
    return (end.when - start.when) * 1e3


# ---- the delay knob -----------------------------------------------------------------

def _delays(text: str) -> dict[str, float]:
    if "=" not in text:
        return {"*": float(text or 0)}
    pairs = (item.split("=", 1) for item in text.split(",") if item.strip())
    return {name.strip(): float(value) for name, value in pairs}


_DELAYS = _delays(os.environ.get("FAKECUDA_KERNEL_DELAY_S", ""))


def kernel_delay(name: str) -> float:
    return _DELAYS.get(name, _DELAYS.get("*", 0.0))


# ---- handles ----------------------------------------------------------------------

_default: Stream | None = None
_default_lock = threading.Lock()
_local = threading.local()


def default_stream() -> Stream:
    global _default
    with _default_lock:
        if _default is None:
            _default = Stream(name="default")
    return _default


def current_stream() -> Stream:
    return getattr(_local, "stream", None) or default_stream()


def stream_at(ptr: int | None) -> Stream:
    if not ptr:
        return default_stream()
    s = _streams.get(int(ptr))
    if s is None:
        raise CudaError(INVALID_HANDLE, f"no stream {int(ptr):#x}")
    return s


def new_event_handle() -> int:
    ev = Event()
    with _registry_lock:
        _events[ev.handle] = ev
    return ev.handle


def event_at(handle: int) -> Event:
    ev = _events.get(int(handle))
    if ev is None:
        raise CudaError(INVALID_HANDLE, f"no event {int(handle):#x}")
    return ev


def destroy_event(handle: int) -> None:
    with _registry_lock:
        if _events.pop(int(handle), None) is None:
            raise CudaError(INVALID_HANDLE, f"no event {int(handle):#x}")


def synchronize_all() -> None:
    for s in list(_streams.values()):
        s.synchronize()


# ---- stream memory operations -------------------------------------------------------

def _write32(addr: int, value: int) -> None:
    r, off = SPACE.resolve(addr, 4, what="stream write")
    r.array[off:off + 4].view("<u4")[0] = value & 0xFFFFFFFF
    trace.emit("write32", region=r.name, offset=off, value=int(value))


def _wait32(addr: int, value: int) -> None:
    while not errors.broken():  # a broken context aborts its waits, as a real one does
        r, off = SPACE.resolve(addr, 4, what="stream wait")
        word = int(r.array[off:off + 4].view("<u4")[0])
        if ((word - value) & 0xFFFFFFFF) < 0x80000000:
            return
        with _changed:  # a stream's write notifies; a CPU's write is seen within 1 ms
            _changed.wait(0.001)


def _sleep(seconds: float) -> None:
    threading.Event().wait(seconds)
