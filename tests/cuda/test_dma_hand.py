"""``kvd.cuda.dma.hand``: DMA copies queued with the driver by a thread, not the event loop.

Drives the real ``DmaPath`` with ``store_thread`` and ``load_thread`` on and CUDA stubbed (the
stand-in of tests/instant_cupy.py, events whose completion the test sets,
driver calls the test holds or refuses): ``store`` returns before the
driver saw the store; the store is done only once the thread queued it and
its event landed; a refused step raises only after the queue's streams were
joined and that event landed; stores reach the driver in the order handed,
from the thread; shutdown waits for the thread at most its timeout; a thread
that cannot take the context fails its stores. Loads (``hand_load``): the
same hand-off, their own thread; the done word behind every row, each layer's
word behind that layer's rows, all from the thread; a cancel stops the rows
but not the done word; the thread waits for the load window; a refused row
still gets the done word, after the joins. The real copies are in
test_fake_gpu_copies.py, test_fake_gpu_lifecycle.py and test_gpu_dma.py.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

import instant_cupy as stub  # noqa: E402
from test_dma_queue import Event  # noqa: E402 - events whose landing the test sets

from kvd.cuda.dma import hand as dma_hand  # noqa: E402
from kvd.cuda.dma import path as dma  # noqa: E402
from kvd.cuda.dma import plan as dma_plan  # noqa: E402
from kvd_protocol import cuda_driver  # noqa: E402
from kvd_protocol.cuda_driver import CudaExportError  # noqa: E402


class Runtime(stub.Runtime):
    joins = 0

    def streamWaitEvent(self, stream, event, flags) -> None:
        Runtime.joins += 1


class Cupy(stub.StubCupy):
    cuda = type("cuda", (stub.Cuda,), {"Event": Event, "runtime": Runtime()})


class Driver:
    """Row batches as the driver gets them: (thread, first dst), held while ``gate`` is
    clear; the ``refuse``-th call (1-based) is refused."""

    def __init__(self) -> None:
        self.calls: list = []
        self.gate = threading.Event()
        self.gate.set()
        self.refuse = 0
        self.after = lambda: None  # called after each batch

    def rows(self, stream, dsts, srcs, sizes) -> None:
        self.gate.wait(10)
        self.calls.append((threading.current_thread().name, int(dsts[0])))
        if len(self.calls) == self.refuse:
            raise CudaExportError("cuMemcpyBatchAsync failed: CUDA error 1")
        self.after()


class Signal:
    """A load's signal as kvd.cuda.signal has it: its words' writes go to the driver's
    calls, by the thread that made them."""

    def __init__(self, driver: Driver, layerwise: bool = False) -> None:
        self.driver, self.layerwise = driver, layerwise
        self.source = type("source", (), {"cancelled": False})()

    def layers_landed(self, stream, layers) -> None:
        self.driver.calls.append((threading.current_thread().name, ("layer", *layers)))

    def done(self, stream) -> None:
        self.driver.calls.append((threading.current_thread().name, "done"))


@pytest.fixture
def per_layer(monkeypatch):
    """A DmaPath with the store thread over a per-layer MLA pool (one row a (layer, page),
    spread over 8 streams: 8 driver calls a store), and the driver stand-in."""
    driver = Driver()
    monkeypatch.setattr(cuda_driver, "memcpy_batch_async", driver.rows)
    monkeypatch.setattr(dma_hand.cuda_driver, "ensure_context", lambda ordinal: None)
    layout, bases = stub.pool(61, 1, 1152, 16, "per-layer")
    settings = dma.DmaSettings(spread_below=1 << 30, store_thread=True, load_thread=True)
    path = dma.DmaPath(Cupy(), 0, settings, (stub.ARENA, stub.PIECE), None)
    ptrs = np.uint64(stub.ARENA) + np.arange(8, dtype=np.uint64) * np.uint64(layout.shard_bytes(16))
    switch = sys.getswitchinterval()
    yield path, layout, bases, dma_plan.pool_groups(layout, bases), ptrs, driver
    driver.gate.set()
    path.close()
    assert sys.getswitchinterval() == switch
    assert path.store_hand._thread is None and path.load_hand._thread is None


def settled(handed: dma_hand.Handed) -> None:
    deadline = time.monotonic() + 10
    while handed.event is None:
        assert time.monotonic() < deadline, "the thread never finished the store"
        time.sleep(0.001)


def test_a_store_returns_before_the_driver_and_is_done_once_queued_and_landed(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    driver.gate.clear()
    stream, how, handed = path.store(layout, bases, groups, np.arange(8), ptrs, 16)
    assert stream is None and how == dma.DIRECT and not driver.calls
    assert sys.getswitchinterval() == pytest.approx(dma_hand.SWITCH_S)
    assert not handed.done  # still in the thread's hands
    driver.gate.set()
    settled(handed)
    assert {name for name, _ in driver.calls} == {"kvd-dma0"} and len(driver.calls) == 8
    assert not handed.done  # queued, not landed
    handed.event.landed = True
    assert handed.done


def test_stores_reach_the_driver_in_the_order_handed(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    driver.gate.clear()
    handed = [path.store(layout, bases, groups, np.arange(8) + 8 * i, ptrs, 16)[2]
              for i in range(5)]
    driver.gate.set()
    for h in handed:
        settled(h)
    firsts = [dst for _, dst in driver.calls[::8]]  # each store's first batch: its first row
    assert firsts == sorted(firsts) and len(driver.calls) == 40
    assert path.store_queue.queued_bytes() == 5 * 8 * layout.shard_bytes(16)


def test_a_refused_step_raises_only_after_the_streams_joined_and_what_was_queued_landed(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    driver.refuse = 3  # the third stream's batch of the first store
    Runtime.joins = 0
    _, _, handed = path.store(layout, bases, groups, np.arange(8), ptrs, 16)
    settled(handed)
    assert isinstance(handed.error, CudaExportError) and len(driver.calls) == 3
    assert Runtime.joins == 1 + 7  # the second stream joined by the step, then all 7 by the fence
    assert not handed.done  # the queued batches may still write the arena
    handed.event.landed = True
    with pytest.raises(CudaExportError):
        handed.done
    _, _, after = path.store(layout, bases, groups, np.arange(8) + 8, ptrs, 16)
    settled(after)  # the thread goes on with the next store
    after.event.landed = True
    assert after.done and len(driver.calls) == 3 + 8


def test_close_lets_the_thread_queue_what_it_was_handed(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    driver.gate.clear()
    handed = [path.store(layout, bases, groups, np.arange(8) + 8 * i, ptrs, 16)[2]
              for i in range(3)]
    threading.Timer(0.2, driver.gate.set).start()
    path.settle()
    assert all(h.event is not None for h in handed) and len(driver.calls) == 24


def test_close_gives_up_after_its_timeout_while_the_thread_is_in_the_driver(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    driver.gate.clear()
    handed = path.store(layout, bases, groups, np.arange(8), ptrs, 16)[2]
    t0 = time.monotonic()
    assert path.settle(0.2) is False and time.monotonic() - t0 < 2
    assert handed.event is None  # nothing freed, nothing reported landed
    driver.gate.set()
    assert path.settle(10) is True and handed.event is not None


def test_a_thread_without_a_context_fails_every_store_handed_to_it(per_layer, monkeypatch):
    path, layout, bases, groups, ptrs, driver = per_layer

    def refuse(ordinal):
        raise CudaExportError("cuDevicePrimaryCtxRetain failed: CUDA error 101")
    monkeypatch.setattr(dma_hand.cuda_driver, "ensure_context", refuse)
    handed = [path.store(layout, bases, groups, np.arange(8) + 8 * i, ptrs, 16)[2]
              for i in range(2)]
    for h in handed:
        settled(h)
        with pytest.raises(CudaExportError, match="error 101"):
            h.done
    assert not driver.calls


def test_a_load_returns_before_the_driver_and_its_done_word_follows_every_row(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    driver.gate.clear()
    handed = path.hand_load(layout, bases, groups, np.arange(8), ptrs, 16, Signal(driver))
    assert not driver.calls and not handed.done
    driver.gate.set()
    settled(handed)
    assert {name for name, _ in driver.calls} == {"kvd-dma0-load"}
    assert [what for _, what in driver.calls][-1] == "done" and len(driver.calls) == 8 + 1
    assert path.store_hand._thread is None  # loads have a thread of their own
    assert not handed.done
    handed.event.landed = True
    assert handed.done


def test_a_layerwise_load_writes_each_layers_word_behind_that_layers_rows(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    handed = path.hand_load(layout, bases, groups, np.arange(8), ptrs, 16, Signal(driver, True))
    settled(handed)
    words = [(i, what) for i, (_, what) in enumerate(driver.calls) if not isinstance(what, int)]
    assert [what for _, what in words] == [("layer", n) for n in range(61)] + ["done"]
    rows_before = [i - k for k, (i, _) in enumerate(words)]  # row batches before each word
    per_layer_rows = np.diff([0, *rows_before[:61]])
    assert per_layer_rows.min() >= 1 and rows_before[61] == rows_before[60]


def test_a_cancelled_load_stops_its_rows_but_still_writes_the_done_word(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    signal = Signal(driver, True)

    def cancel_once_the_first_layer_landed() -> None:
        if driver.calls and driver.calls[-1][1] == ("layer", 0):
            signal.source.cancelled = True  # as the client does, between two steps
    driver.after = cancel_once_the_first_layer_landed
    layers_landed = signal.layers_landed
    signal.layers_landed = lambda stream, layers: (layers_landed(stream, layers), driver.after())
    handed = path.hand_load(layout, bases, groups, np.arange(8), ptrs, 16, signal)
    settled(handed)
    words = [what for _, what in driver.calls if not isinstance(what, int)]
    assert words == [("layer", 0), "done"] and driver.calls[-2][1] == ("layer", 0)
    handed.event.landed = True
    assert handed.done


def test_a_load_thread_waits_for_the_load_window(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    chunk = layout.shard_bytes(16)
    path.window = 2 * chunk  # steps of half a chunk: the thread stops at 2 chunks queued
    steps, enqueue = [], path.load_queue.enqueue
    path.load_queue.enqueue = lambda step, n=None: steps.append(step.nbytes) or enqueue(step, n)
    handed = path.hand_load(layout, bases, groups, np.random.default_rng(0).permutation(8), ptrs,
                            16, Signal(driver))
    time.sleep(0.2)
    queued = path.load_queue.queued_bytes()
    assert handed.event is None and 2 * chunk < queued <= 3 * chunk
    assert "done" not in [what for _, what in driver.calls]
    assert _land_all(path.load_queue, handed), "the thread never went on"
    assert [what for _, what in driver.calls][-1] == "done"
    assert sum(steps) == 8 * chunk and len(steps) > 4


def test_a_refused_load_row_still_gets_the_done_word_after_the_joins(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    driver.refuse = 3
    Runtime.joins = 0
    handed = path.hand_load(layout, bases, groups, np.arange(8), ptrs, 16, Signal(driver))
    settled(handed)
    assert [what for _, what in driver.calls][3:] == ["done"]
    assert Runtime.joins == 1 + 7 and isinstance(handed.error, CudaExportError)
    handed.event.landed = True
    with pytest.raises(CudaExportError):
        handed.done


def test_close_gives_up_after_its_timeout_while_a_load_waits_for_its_window(per_layer):
    path, layout, bases, groups, ptrs, driver = per_layer
    path.window = layout.shard_bytes(16)
    handed = path.hand_load(layout, bases, groups, np.arange(8), ptrs, 16, Signal(driver))
    assert path.settle(0.2) is False and handed.event is None
    for event, _, _ in list(path.load_queue.queued):
        event.landed = True
    path.load_queue.queued_bytes()
    threading.Thread(target=_land_all, args=(path.load_queue, handed), daemon=True).start()
    assert path.settle(10) is True and handed.event is not None


def _land_all(q, handed, timeout: float = 10) -> bool:
    """Land every batch of ``q`` as soon as it is queued until the thread recorded
    ``handed``'s event; whether it did within ``timeout``."""
    deadline = time.monotonic() + timeout
    while handed.event is None:
        if time.monotonic() > deadline:
            return False
        for event, _, _ in list(q.queued):
            event.landed = True
        time.sleep(0.001)
    return True
