"""``cupy.cuda`` of the fake GPU: devices, streams, events and allocations as kvd uses them.

``Device(i)`` (a context manager making ``i`` current on this thread, with
``attributes["MultiProcessorCount"]``), ``Stream`` and ``Event``
(fakecuda.streams), ``get_current_stream()``, ``alloc(n)`` (device memory,
freed when the returned ``MemoryPointer`` is collected, as CuPy returns it
to its pool; queued work that still uses it then faults, which is what a
use-after-free should do in a test), ``alloc_pinned_memory(n)`` (pinned
host memory as a buffer, kept until the process exits), and the
``runtime`` and ``driver`` modules, and ``get_elapsed_time`` (ms between two
completed events). Only what kvd.cuda calls is here.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

from . import errors, runtime
from .errors import INVALID_VALUE, CudaError
from .memory import SPACE
from .streams import Event, Stream, current_stream, get_elapsed_time

driver = SimpleNamespace(CUDADriverError=CudaError)
__all__ = ["Device", "Event", "MemoryPointer", "Stream", "alloc", "alloc_pinned_memory", "driver",
           "get_current_stream", "get_elapsed_time", "runtime"]
_local = threading.local()


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = getattr(_local, "device", 0) if device is None else int(device)
        if not 0 <= self.id < runtime.device_count():
            raise CudaError(INVALID_VALUE, f"no device {self.id}")
        self.attributes = {"MultiProcessorCount": runtime.MULTIPROCESSORS}
        self._outer: list[int] = []

    def __enter__(self) -> "Device":
        self._outer.append(getattr(_local, "device", 0))
        _local.device = self.id
        return self

    def __exit__(self, *exc: object) -> None:
        _local.device = self._outer.pop()

    def use(self) -> None:
        _local.device = self.id

    def synchronize(self) -> None:
        runtime.deviceSynchronize()


def get_current_stream() -> Stream:
    return current_stream()


class MemoryPointer:
    def __init__(self, size: int) -> None:
        errors.check()
        self.mem = SPACE.alloc(size, getattr(_local, "device", 0))
        self.ptr = self.mem.base
        self.size = size

    def __del__(self) -> None:
        try:
            SPACE.free(self.ptr)
        except Exception:
            pass


def alloc(size: int) -> MemoryPointer:
    return MemoryPointer(size)


def alloc_pinned_memory(size: int):
    errors.check()
    return SPACE.alloc_pinned(size).owner
