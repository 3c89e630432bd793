"""kvd.copy.poll without a GPU: objects with a ``done`` property stand in for CUDA events."""

from __future__ import annotations

import asyncio
import selectors
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


def test_a_cancelled_waiter_is_dropped():
    async def main():
        poller = EventPoller()
        gone = poller.wait(FakeEvent(10.0))
        gone.cancel()
        await poller.wait(FakeEvent(0.02))
        assert not poller.pending and not poller._scheduled
    asyncio.run(main())


class NoYieldSelector(selectors.DefaultSelector):
    """A loop's poll phase that never lets go of the GIL when it must not wait (no syscall),
    so other threads run only when the poller yields: the worst case the poller guards."""

    def select(self, timeout=None):
        if timeout is not None and timeout <= 0:
            return []
        return super().select(timeout)


WAKEUPS, NAP, LATE = 400, 0.0002, 0.002


def _late_share(spin) -> float:
    """Share of a thread's wakeups from a short sleep that got the GIL back more than
    ``LATE`` late, while ``spin(thread)`` runs on this thread."""
    late = []

    def wakeups():  # as an IO thread: blocking calls without the GIL, Python in between
        for _ in range(WAKEUPS):
            t0 = time.perf_counter()
            time.sleep(NAP)
            late.append(time.perf_counter() - t0 - NAP > LATE)

    t = threading.Thread(target=wakeups)
    t.start()
    spin(t)
    t.join()
    return sum(late) / len(late)


def test_polling_does_not_starve_other_threads_of_the_gil():
    """While events are pending the loop never sleeps; each pass must let waiting threads
    take the GIL, or an IO thread waits the whole switch interval (5 ms) every time it
    needs it. Measured against the same thread with nothing else running."""
    def polling(t):
        async def main():
            poller = EventPoller()
            pending = poller.wait(FakeEvent(60.0))
            while t.is_alive():
                await asyncio.sleep(0.001)  # the loop is otherwise idle: the poller spins
            pending.cancel()
        loop = asyncio.SelectorEventLoop(NoYieldSelector())
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    baseline = _late_share(lambda t: t.join())
    starved = _late_share(polling)
    assert starved <= baseline + 0.2, (f"{starved:.0%} of wakeups waited more than "
                                       f"{LATE * 1e3:.0f} ms for the GIL ({baseline:.0%} alone)")
