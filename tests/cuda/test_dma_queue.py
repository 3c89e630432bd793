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

import sys
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
