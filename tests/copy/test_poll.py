"""kvd.copy.poll without a GPU: objects with a ``done`` property stand in for CUDA events."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvd.copy.poll import EventPoller


class FakeEvent:
    def __init__(self, after_s: float = 0.0, error: Exception | None = None):
        self.at = time.monotonic() + after_s
        self.error = error

    @property
    def done(self) -> bool:
        if self.error is not None:
            raise self.error
        return time.monotonic() >= self.at


def test_futures_resolve_in_completion_order_and_the_loop_stays_responsive():
    async def main():
        poller = EventPoller()
        order = []
        slow, fast = poller.wait(FakeEvent(0.05)), poller.wait(FakeEvent(0.01))
        slow.add_done_callback(lambda _: order.append("slow"))
        fast.add_done_callback(lambda _: order.append("fast"))
        ticks = 0
        while not slow.done():  # other work on the loop keeps running meanwhile
            ticks += 1
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # done callbacks run on the next pass
        assert order == ["fast", "slow"] and ticks > 10
        assert not poller.pending and not poller._scheduled
        late = poller.wait(FakeEvent(0.0))  # polling starts again after going idle
        await asyncio.wait_for(late, 1)
    asyncio.run(main())


def test_a_failed_query_fails_only_its_future():
    async def main():
        poller = EventPoller()
        bad = poller.wait(FakeEvent(error=RuntimeError("cudaErrorIllegalAddress")))
        good = poller.wait(FakeEvent(0.01))
        with pytest.raises(RuntimeError, match="Illegal"):
            await bad
        await asyncio.wait_for(good, 1)
    asyncio.run(main())


def test_a_cancelled_waiter_is_dropped_and_threads_get_the_gil():
    async def main():
        poller = EventPoller()
        gone = poller.wait(FakeEvent(10.0))
        gone.cancel()
        counted = []

        def worker():  # a pure-Python thread, as the disk tier's IO threads partly are
            n, end = 0, time.monotonic() + 0.1
            while time.monotonic() < end:
                n += 1
            counted.append(n)

        t = threading.Thread(target=worker)
        t.start()
        await poller.wait(FakeEvent(0.2))
        t.join()
        assert counted and counted[0] > 1000 and not poller.pending
    asyncio.run(main())
