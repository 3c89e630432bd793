"""A CuPy whose every call returns at once, and pool layouts to plan copies over: for tests of
the daemon's DMA planning and queuing (kvd.cuda.dma.path, kvd.cuda.dma.staging) on any machine.

``StubCupy`` serves the CuPy calls kvd.cuda.dma.path and kvd.cuda.dma.staging make (streams, events,
runtime calls, allocations), each doing nothing; tests subclass ``Cuda``/``Runtime`` to record
or hold what they care about. ``pool(layers, planes, row, page_size, kind)`` is a layout and
its plane bases as vLLM (``one``, ``block-outer``) or SGLang (``per-layer``) allocate them.
Addresses are made up and never dereferenced: nothing here touches memory.
"""

from __future__ import annotations

from itertools import count

import numpy as np

from kvd_protocol.layout import LayoutDescriptor

POOL_PAGES = 1 << 14
ARENA, PIECE = 1 << 40, 1 << 30  # the arena's base and registration piece, as the daemon's
_ptrs = count(1 << 20, 1 << 12)


class Stream:
    def __init__(self, non_blocking: bool = True) -> None:
        self.ptr = next(_ptrs)

    def wait_event(self, event) -> None:
        pass


class Event:
    done = True

    def __init__(self, block: bool = False, disable_timing: bool = True) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


class Runtime:
    @staticmethod
    def eventCreateWithFlags(flags: int) -> int:
        return next(_ptrs)

    def __getattr__(self, name: str):  # eventRecord, streamWaitEvent, memcpy2DAsync, ...
        return lambda *args: None


class Device:
    def __init__(self, ordinal: int) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def use(self) -> None:
        pass


class Alloc:
    def __init__(self, nbytes: int) -> None:
        self.ptr = next(_ptrs) << 20


class Cuda:
    Stream, Event, Device, runtime = Stream, Event, Device, Runtime()

    @staticmethod
    def alloc(nbytes: int) -> Alloc:
        return Alloc(nbytes)


class StubCupy:
    """What kvd.cuda.dma.path and kvd.cuda.dma.staging call of CuPy, each call returning at once."""
    cuda = Cuda


def pool(layers: int, planes: int, row: int, page_size: int, kind: str = "one") -> tuple:
    """A layout and its plane bases: every (layer, plane) in one allocation, plane after
    plane (``one``: vLLM's single allocation) or page after page (``block-outer``: a
    page's planes adjacent, vLLM 0.32's ``BLHNC`` family); or each layer its own
    allocation (``per-layer``: SGLang's)."""
    plane_page = page_size * row
    stride = plane_page * layers * planes if kind == "block-outer" else plane_page
    apart = plane_page if kind == "block-outer" else POOL_PAGES * plane_page
    if kind == "per-layer":
        bases = tuple((i // planes, (i % planes) * apart) for i in range(layers * planes))
        apart += 1 << 21  # the allocations lie apart: no pitch spans two
    else:
        bases = tuple((0, i * apart) for i in range(layers * planes))
    d = LayoutDescriptor(layers, planes, POOL_PAGES, page_size, row, stride, row, bases)
    return d, np.uint64(1 << 30) + np.arange(layers * planes, dtype=np.uint64) * np.uint64(apart)
