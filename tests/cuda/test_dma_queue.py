"""``kvd.cuda.dma.DmaQueue`` keeps only the batches that have not landed.

It drives the real ``DmaPath`` and ``DmaQueue`` with CUDA stubbed
(tools/dma_host_cost.py's stand-in for CuPy, with events whose completion
the test sets): a daemon that only stores never waits on its store queue,
so the queue itself must let go of what landed, or every store's event and
op arrays stay for the daemon's lifetime. Batches land in the order they
were queued (one stream), so finding what landed queries the oldest only.
The real copies are in test_fake_gpu_dma.py and test_gpu_dma.py.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import dma_host_cost as stub  # noqa: E402

from kvd.cuda import dma, dma_plan  # noqa: E402


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
    cuda = type("cuda", (stub._Cuda,), {"Event": Event})


@pytest.fixture
def mla(monkeypatch):
    """A DmaPath over MLA's shape (one allocation), and what a copy of 8 chunks needs."""
    monkeypatch.setattr(dma.cuda_driver, "memcpy3d_batch_async", lambda stream, at, n: None)
    monkeypatch.setattr(dma.cuda_driver, "memcpy_batch_async", lambda stream, d, s, n: None)
    layout, bases = stub.pool(61, 1, 1152, 16)
    path = dma.DmaPath(Cupy(), 0, dma.DmaSettings(), (stub.ARENA, stub.PIECE), None)
    shard = layout.shard_bytes(16)
    ptrs = np.uint64(stub.ARENA) + np.arange(8, dtype=np.uint64) * np.uint64(shard)
    yield path, layout, bases, dma_plan.pool_groups(layout, bases), ptrs
    path.close()


def test_a_store_queue_lets_go_of_batches_that_landed(mla):
    path, layout, bases, groups, ptrs = mla
    q = path.store_queue
    for i in range(200):
        asyncio.run(path.store(layout, bases, groups, np.arange(8) + 8 * i, ptrs, 16))
        for event, _, _ in q.queued:
            event.landed = True
    assert 1 <= len(q.queued) <= 2  # the last store's batches, until the next copy
    assert q.queued_bytes() == 0 and not q.queued


def test_queued_bytes_counts_what_has_not_landed_and_queries_the_oldest_only(mla):
    path, layout, bases, groups, ptrs = mla
    q = path.store_queue
    for i in range(6):
        asyncio.run(path.store(layout, bases, groups, np.arange(8) + 8 * i, ptrs, 16))
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


@pytest.fixture
def per_layer(monkeypatch):
    """A DmaPath over per-layer MLA pages of 64 (72 KiB rows: one stream) whose driver
    calls record the thread that made them, and a copy of 8 chunks of 256 tokens (1,952
    rows at page ids apart)."""
    calls: list = []

    def batch(stream, dsts, srcs, sizes):
        calls.append((threading.current_thread().name, len(sizes)))
        if getattr(batch, "refuse", False):
            raise dma.cuda_driver.CudaExportError("refused")
    monkeypatch.setattr(dma.cuda_driver, "memcpy_batch_async", batch)
    monkeypatch.setattr(dma.cuda_driver, "memcpy3d_batch_async", lambda stream, at, n: None)
    layout, bases = stub.pool(61, 1, 1152, 64, "per-layer")
    shard = layout.shard_bytes(256)
    ptrs = np.uint64(stub.ARENA) + np.arange(8, dtype=np.uint64) * np.uint64(shard)
    yield layout, bases, dma_plan.pool_groups(layout, bases), ptrs, calls, batch


def per_layer_path(thread_rows: int, poller=None, window: int = 256 << 20) -> dma.DmaPath:
    settings = dma.DmaSettings(thread_rows=thread_rows, load_window=window)
    return dma.DmaPath(Cupy(), 0, settings, (stub.ARENA, stub.PIECE), poller)


def test_a_large_one_stream_step_goes_to_the_driver_from_the_queues_thread(per_layer):
    layout, bases, groups, ptrs, calls, _ = per_layer
    for rows, thread in ((256, "kvd-dma0"), (0, "MainThread"), (4096, "MainThread")):
        path = per_layer_path(rows)
        calls.clear()
        stream, how = asyncio.run(path.store(layout, bases, groups, np.arange(32) * 2, ptrs, 256))
        assert how == dma.DIRECT and stream is path.store_queue.stream
        assert [name.split("_")[0] for name, _ in calls] == [thread] and calls[0][1] == 1952
        q = path.store_queue
        assert len(q.queued) == 1 and q.queued_bytes() == 8 * layout.shard_bytes(256)
        assert not q._handoffs
        q.queued[0][0].landed = True
        assert q.queued_bytes() == 0 and not q.queued
        path.close()


def test_a_refused_handed_step_raises_in_its_copy_and_counts_nothing(per_layer):
    layout, bases, groups, ptrs, calls, batch = per_layer
    path = per_layer_path(256)
    batch.refuse = True
    with pytest.raises(dma.cuda_driver.CudaExportError):
        asyncio.run(path.store(layout, bases, groups, np.arange(32) * 2, ptrs, 256))
    q = path.store_queue
    assert calls and calls[0][0].startswith("kvd-dma0")
    assert q.queued_bytes() == 0 and not q.queued and not q._handoffs
    path.close()


def test_a_cancelled_copy_still_tracks_the_step_it_handed_over(per_layer):
    """The driver may have the step when its copy is cancelled: its bytes and event stay
    tracked, so the window and the arrays the driver reads outlive the copy's task."""
    layout, bases, groups, ptrs, calls, _ = per_layer
    path = per_layer_path(256)
    gate = threading.Event()
    original = dma.DmaQueue._hand

    def slow_hand(self, step):
        gate.wait(5)
        return original(self, step)

    async def cancel_mid_handoff() -> None:
        task = asyncio.ensure_future(path.store(layout, bases, groups, np.arange(32) * 2, ptrs, 256))
        await asyncio.sleep(0.05)
        assert path.store_queue._handoffs  # handed over, not back yet
        task.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        while path.store_queue._handoffs:
            await asyncio.sleep(0.01)

    dma.DmaQueue._hand = slow_hand
    try:
        asyncio.run(cancel_mid_handoff())
    finally:
        dma.DmaQueue._hand = original
    q = path.store_queue
    assert len(q.queued) == 1 and q.queued_bytes() == 8 * layout.shard_bytes(256)
    path.close()


def test_a_load_in_many_handed_steps_keeps_its_window(per_layer):
    """A window of two steps: each load step waits until the bytes queued (handed over
    included) are back under it; every step reaches the driver once, in order."""
    layout, bases, groups, ptrs, calls, _ = per_layer
    landed: list = []

    class Poller:  # every batch lands a moment after it is waited on
        def wait(self, event):
            fut = asyncio.get_running_loop().create_future()
            event.landed = True
            landed.append(event)
            asyncio.get_running_loop().call_later(0.002, fut.set_result, None)
            return fut

    step_bytes = 9 * layout.shard_bytes(256) // 8  # about a chunk: 9 steps of 1952 / 8 rows
    path = per_layer_path(64, Poller(), window=4 * step_bytes)
    q = path.load_queue
    seen = []
    real_track = q._track

    def track(done, nbytes, keep):
        seen.append(q._bytes)
        real_track(done, nbytes, keep)
    q._track = track
    how = asyncio.run(path.load(layout, bases, groups, np.arange(32) * 2, ptrs, 256, None))
    assert how == dma.DIRECT
    assert sum(n for _, n in calls) == 1952 and len(calls) > 4
    assert all(name.startswith("kvd-dma0") for name, _ in calls)
    assert max(seen) <= 4 * step_bytes + step_bytes  # the window, and the step in hand
    path.close()


def test_loads_waiting_on_steps_in_hand_neither_fail_nor_spin(per_layer):
    """Six loads, steps of a quarter of the window, the driver slow to take each step
    (batches land at once): the fifth load finds the window full of steps still in hand
    (nothing tracked) and waits for a hand-off instead of a landed batch."""
    layout, bases, groups, ptrs, calls, _ = per_layer
    waits: list = []

    class Poller:
        def wait(self, event):
            fut = asyncio.get_running_loop().create_future()
            event.landed = True
            asyncio.get_running_loop().call_later(0.001, fut.set_result, None)
            return fut

    path = per_layer_path(64, Poller(), window=4 * layout.shard_bytes(256))
    q, original = path.load_queue, dma.DmaQueue._hand
    real_landing = q.landing

    async def landing():
        waits.append((len(q.queued), len(q._handoffs)))
        await real_landing()
    q.landing = landing

    def slow_hand(self, step):
        threading.Event().wait(0.01)
        return original(self, step)

    async def two_loads() -> list:
        return await asyncio.gather(*(path.load(layout, bases, groups, np.arange(32) * 2 + k,
                                                ptrs, 256, None) for k in range(6)))
    dma.DmaQueue._hand = slow_hand
    try:
        assert asyncio.run(asyncio.wait_for(two_loads(), 10)) == [dma.DIRECT] * 6
    finally:
        dma.DmaQueue._hand = original
    assert sum(n for _, n in calls) == 6 * 1952
    assert any(tracked == 0 and handing for tracked, handing in waits)  # hand-offs alone
    assert len(waits) < 200  # waits, not a spin
    path.close()
