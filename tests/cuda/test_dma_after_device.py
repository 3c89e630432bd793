"""A DMA load follows the kernels GPU Direct Storage queued for the same load.

GDS scatters its chunks with kernels on the GPU's load kernel stream
(``CudaCopyEngine.scatter_device``); the host tier's chunks of the same
load go by DMA on the load queue's streams, and the layer words, the done
word and the completion ride on those. Unless those streams wait for the
kernels (``CopyPlan.after_device``), the engine can read GDS's pages before
they land, and a dead engine's pool can be closed under them. Drives the
real ``CudaCopyEngine._scatter_dma`` and ``DmaPath`` with CUDA stubbed
(tests/instant_cupy.py's stand-in, recording the runtime's event calls and
the driver's batches): with ``after_device``, every load stream waits on an
event recorded on the kernel stream before the load's first batch, whether
the loop or the load thread queues it; without it, no stream waits on the
kernel stream. The real copies: tests/cuda/test_gpu_gds.py.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import instant_cupy as stub  # noqa: E402
from test_dma_queue import Event  # noqa: E402 - events whose landing the test sets

from kvd.copy.plan import CopyPlan  # noqa: E402
from kvd.copy.poll import EventPoller  # noqa: E402
from kvd.cuda.backend import CudaCopyEngine  # noqa: E402
from kvd.cuda.devices import CudaPool, GpuDevice  # noqa: E402
from kvd.cuda.dma import hand as dma_hand  # noqa: E402
from kvd.cuda.dma import path as dma  # noqa: E402
from kvd.cuda.dma import plan as dma_plan  # noqa: E402
from kvd_protocol import cuda_driver  # noqa: E402

CALLS: list = []  # ("record", stream) / ("wait", stream) / ("rows", stream), in order


class Runtime(stub.Runtime):
    def eventRecord(self, event, stream) -> None:
        CALLS.append(("record", stream))

    def streamWaitEvent(self, stream, event, flags) -> None:
        CALLS.append(("wait", stream))


class Cupy(stub.StubCupy):
    cuda = type("cuda", (stub.Cuda,), {"Event": Event, "runtime": Runtime()})


def rows(stream, dsts, srcs, sizes) -> None:
    CALLS.append(("rows", stream))


def _engine(load_thread: bool) -> tuple[CudaCopyEngine, CudaPool, object]:
    """An engine of one stubbed GPU with one per-layer MLA pool (one row a (layer, page))."""
    layout, bases = stub.pool(61, 1, 1152, 16, "per-layer")
    settings = dma.DmaSettings(streams=4, load_thread=load_thread)
    path = dma.DmaPath(Cupy(), 0, settings, (stub.ARENA, stub.PIECE), EventPoller())
    dev = GpuDevice(0, None, [Cupy.cuda.Stream() for _ in range(4)], None, None, path)
    engine = object.__new__(CudaCopyEngine)  # its __init__ would take a GPU; the rest is real
    engine.cp, engine.poller = Cupy(), path.poller
    pool = CudaPool(dev, [], bases, None, True, dma_plan.pool_groups(layout, bases))
    return engine, pool, layout


async def _load(engine, pool, layout, after_device: bool) -> None:
    plan = CopyPlan(pool, layout, 16, np.random.default_rng(0).permutation(8), [0] * 8,
                    after_device=after_device)
    ptrs = np.uint64(stub.ARENA) + np.arange(8, dtype=np.uint64) * np.uint64(layout.shard_bytes(16))
    landed = await engine._scatter_dma(plan, ptrs, None, time.perf_counter())
    deadline = time.monotonic() + 10
    while not landed.done():  # every event lands once created (the thread's too)
        assert time.monotonic() < deadline, "the load never landed"
        for event in list(Event.instances):
            event.landed = True
        await asyncio.sleep(0.001)
    await landed


@pytest.mark.parametrize("load_thread", [False, True], ids=["loop", "load thread"])
@pytest.mark.parametrize("after_device", [False, True])
def test_a_dma_load_waits_for_the_kernel_stream_only_after_device_work(monkeypatch, load_thread,
                                                                       after_device):
    monkeypatch.setattr(cuda_driver, "memcpy_batch_async", rows)
    monkeypatch.setattr(dma_hand.cuda_driver, "ensure_context", lambda ordinal: None)
    monkeypatch.setattr(Event, "instances", [], raising=False)
    monkeypatch.setattr(Event, "__init__", _tracked_init)
    engine, pool, layout = _engine(load_thread)
    CALLS.clear()
    try:
        asyncio.run(_load(engine, pool, layout, after_device))
    finally:
        pool.device.dma.close()
    kernels, loads = pool.device.streams[2].ptr, [s.ptr for s in pool.device.dma.load_queue.streams]
    first = next(i for i, c in enumerate(CALLS) if c[0] == "rows")
    recorded = [i for i, c in enumerate(CALLS) if c == ("record", kernels)]
    if not after_device:
        assert not recorded
        return
    assert len(recorded) == 1 and recorded[0] < first, CALLS
    waits = {c[1] for c in CALLS[recorded[0]:first] if c[0] == "wait"}
    assert waits == set(loads), CALLS[:first + 1]


def _tracked_init(self, block: bool = False, disable_timing: bool = True) -> None:
    self.landed = False
    Event.instances.append(self)
