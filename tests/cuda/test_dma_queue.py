"""``kvd.cuda.dma.queue.DmaQueue`` keeps only the batches that have not landed.

It drives the real ``DmaPath`` and ``DmaQueue`` with CUDA stubbed
(tests/instant_cupy.py's stand-in for CuPy, with events whose completion
the test sets): a daemon that only stores never waits on its store queue,
so the queue itself must let go of what landed, or every store's event and
op arrays stay for the daemon's lifetime. Batches land in the order they
were queued (one stream), so finding what landed queries the oldest only.
The real copies are in test_fake_gpu_dma.py and test_gpu_dma.py.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import instant_cupy as stub  # noqa: E402

from kvd.copy.poll import EventPoller  # noqa: E402
from kvd.cuda.dma import path as dma  # noqa: E402
from kvd.cuda.dma import plan as dma_plan  # noqa: E402
from kvd_protocol import cuda_driver  # noqa: E402


class Event:
    """A CUDA event whose completion the test sets; counts how often it was queried."""
    landed = False
    queries = 0

    def __init__(self, block: bool = False, disable_timing: bool = True) -> None:
        self.landed = False

    def record(self, stream=None) -> None:
        pass

    @property
    def done(self) -> bool:
        Event.queries += 1
        return self.landed


class Cupy(stub.StubCupy):
    cuda = type("cuda", (stub.Cuda,), {"Event": Event})


@pytest.fixture
def mla(monkeypatch):
    """A DmaPath over MLA's shape (one allocation), and what a copy of 8 chunks needs."""
    monkeypatch.setattr(cuda_driver, "memcpy3d_batch_async", lambda stream, at, n: None)
    monkeypatch.setattr(cuda_driver, "memcpy_batch_async", lambda stream, d, s, n: None)
    layout, bases = stub.pool(61, 1, 1152, 16)
    settings = dma.DmaSettings(store_thread=False, load_thread=False)  # the loop's (test_dma_hand.py)
    path = dma.DmaPath(Cupy(), 0, settings, (stub.ARENA, stub.PIECE), None)
    shard = layout.shard_bytes(16)
    ptrs = np.uint64(stub.ARENA) + np.arange(8, dtype=np.uint64) * np.uint64(shard)
    yield path, layout, bases, dma_plan.pool_groups(layout, bases), ptrs
    path.close()


def test_a_store_queue_lets_go_of_batches_that_landed(mla):
    path, layout, bases, groups, ptrs = mla
    q = path.store_queue
    for i in range(200):
        path.store(layout, bases, groups, np.arange(8) + 8 * i, ptrs, 16)
        for event, _, _ in q.queued:
            event.landed = True
    assert 1 <= len(q.queued) <= 2  # the last store's batches, until the next copy
    assert q.queued_bytes() == 0 and not q.queued


def test_queued_bytes_counts_what_has_not_landed_and_queries_the_oldest_only(mla):
    path, layout, bases, groups, ptrs = mla
    q = path.store_queue
    for i in range(6):
        path.store(layout, bases, groups, np.arange(8) + 8 * i, ptrs, 16)
    batches = list(q.queued)
    total = sum(nbytes for _, nbytes, _ in batches)
    assert len(batches) >= 6 and total == 6 * 8 * layout.shard_bytes(16)
    Event.queries = 0
    assert q.queued_bytes() == total and Event.queries == 1
    for event, _, _ in batches[:3]:
        event.landed = True
    Event.queries = 0
    assert q.queued_bytes() == total - sum(nbytes for _, nbytes, _ in batches[:3])
    assert Event.queries == 4 and list(q.queued) == batches[3:]
    assert q.idle_for() == 0.0
    for event, _, _ in batches[3:]:
        event.landed = True
    assert q.queued_bytes() == 0 and q.idle_for() >= 0.0


class Signal:
    """A load's signal as kvd.cuda.signal has it: the cancel word the client may set."""

    def __init__(self) -> None:
        self.layerwise = False
        self.source = type("source", (), {"cancelled": False})()


def _small_window_path(layout, window: int) -> tuple[dma.DmaPath, list]:
    """A DmaPath with a poller and a load window of ``window``; the bytes of each step
    it queues on its load queue."""
    settings = dma.DmaSettings(load_window=window, store_thread=False, load_thread=False)
    path = dma.DmaPath(Cupy(), 0, settings, (stub.ARENA, stub.PIECE), EventPoller())
    steps, enqueue = [], path.load_queue.enqueue
    path.load_queue.enqueue = lambda step, n=None: steps.append(step.nbytes) or enqueue(step, n)
    return path, steps


async def _land_until_done(q: dma.DmaQueue, rest) -> None:
    """Run ``rest`` while every queued batch lands at once."""
    task = asyncio.ensure_future(rest())
    while not task.done():
        for event, _, _ in list(q.queued):
            event.landed = True
        await asyncio.sleep(0)
    await task


def test_a_load_queues_what_the_window_admits_before_it_returns(mla):
    _, layout, bases, groups, ptrs = mla
    path, steps = _small_window_path(layout, 4 << 20)  # steps of 1 MiB: a chunk (1.1 MB) each
    chunk = layout.shard_bytes(16)

    async def load() -> None:
        how, rest = path.load(layout, bases, groups, np.arange(8), ptrs, 16, Signal())
        assert how == dma.DIRECT and rest is not None
        assert steps == [chunk] * 4  # queued before any await: 4.4 MB fill the 4 MiB window
        assert path.load_queue.queued_bytes() == 4 * chunk
        await _land_until_done(path.load_queue, rest)
    try:
        asyncio.run(load())
        assert steps == [chunk] * 8  # the rest after some landed, each step once
    finally:
        path.close()


def test_a_load_within_the_window_is_queued_whole_and_leaves_nothing_to_await(mla):
    _, layout, bases, groups, ptrs = mla
    path, steps = _small_window_path(layout, 256 << 20)

    async def load() -> None:
        _, rest = path.load(layout, bases, groups, np.arange(8), ptrs, 16, Signal())
        assert rest is None and sum(steps) == 8 * layout.shard_bytes(16)
    try:
        asyncio.run(load())
    finally:
        path.close()


def test_a_cancelled_load_queues_nothing_more_after_its_first_steps(mla):
    _, layout, bases, groups, ptrs = mla
    (path, steps), signal = _small_window_path(layout, 4 << 20), Signal()

    async def load() -> None:
        _, rest = path.load(layout, bases, groups, np.arange(8), ptrs, 16, signal)
        signal.source.cancelled = True  # the client's cancel word, seen before the next step
        await asyncio.wait_for(_land_until_done(path.load_queue, rest), 5)
    try:
        asyncio.run(load())
        assert steps == [layout.shard_bytes(16)] * 4
    finally:
        path.close()


def test_batches_add_nothing_to_the_pollers_pass_and_idle_counts_from_the_last_landing(mla):
    """Every pending poller entry is a query in each pass of the daemon's event loop: a
    batch adds none (its copy's completion future, polled by the caller anyway, calls
    ``landed``); the staging rule's ``idle_for`` counts from the last landing seen."""
    _, layout, bases, groups, ptrs = mla
    path, _ = _small_window_path(layout, 256 << 20)

    async def copies() -> None:
        for i in range(3):
            path.store(layout, bases, groups, np.arange(8) + 8 * i, ptrs, 16)
        _, rest = path.load(layout, bases, groups, np.arange(8), ptrs, 16, Signal())
        assert rest is None and not path.poller.pending
    try:
        asyncio.run(copies())
        q = path.store_queue
        assert q.idle_for() == 0.0  # batches queued
        for event, _, _ in q.queued:
            event.landed = True
        time.sleep(0.05)
        before = time.monotonic()
        q.landed()  # the last store's completion future resolved
        time.sleep(0.02)
        assert 0.02 <= q.idle_for() <= time.monotonic() - before
        assert not q.queued
    finally:
        path.close()
