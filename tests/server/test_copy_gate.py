"""kvd.server.copy_gate: how many copies a client may queue, alone and next to others.

The gate is the daemon's policy object, driven here on a real event loop
with sessions as plain objects (it keys on identity). What must hold: a
session alone in a queue gets ``alone`` copies queued, or more while they
total at most ``alone_bytes``; once another session
queues or waits there, a session gets ``fair``; the other session is never
held back by the first one's count; ``None`` queues (host backend) keep
``fair`` per session across directions; a cancelled waiter leaves nothing
behind and lets the others go on; every count returns to zero.
"""

from __future__ import annotations

import asyncio

import pytest

from kvd.server.copy_gate import CopyGate


class Session:
    pass


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def entered(gate, session, queue, timeout=0.05, nbytes=0) -> bool:
    """Whether ``enter`` returns within ``timeout`` (if not, the waiter is cancelled)."""
    try:
        await asyncio.wait_for(gate.enter(session, queue, nbytes), timeout)
        return True
    except asyncio.TimeoutError:
        return False


def test_alone_a_session_queues_two_then_waits():
    async def body():
        gate, a = CopyGate(1, 2), Session()
        assert gate.idle.is_set()
        was_idle_since = gate.idle.since
        assert await entered(gate, a, (0, "store"))
        assert not gate.idle.is_set()  # the journal's hashing waits meanwhile
        assert await entered(gate, a, (0, "store"))
        assert not await entered(gate, a, (0, "store"))
        gate.leave(a, (0, "store"))
        assert await entered(gate, a, (0, "store"))
        assert await entered(gate, a, (0, "load"))  # the other direction is another queue
        assert gate.total == 3
        for q in ((0, "store"), (0, "store"), (0, "load")):
            assert not gate.idle.is_set()
            gate.leave(a, q)
        assert gate.idle.is_set() and gate.idle.since > was_idle_since  # idle from now on
        assert gate.total == 0 and not gate.queued and not gate.waiting
    run(body())


def test_next_to_another_session_each_gets_the_fair_share():
    async def body():
        gate, a, b, q = CopyGate(1, 2), Session(), Session(), (0, "store")
        assert await entered(gate, a, q)
        assert await entered(gate, a, q)           # alone: two queued
        assert await entered(gate, b, q)           # never held back by a's count
        assert not await entered(gate, b, q)       # b: fair share (a has copies queued)
        gate.leave(a, q)
        assert not await entered(gate, a, q)       # a still has one, b is there: fair is 1
        gate.leave(a, q)
        waiter = asyncio.ensure_future(gate.enter(a, q))
        await asyncio.sleep(0.01)
        assert waiter.done()                       # a at zero: one copy, as b's fair share
        gate.leave(b, q)                           # b gone: a alone again
        assert await entered(gate, a, q)
        gate.leave(a, q)
        gate.leave(a, q)
        assert gate.total == 0 and not gate.queued and not gate.waiting
    run(body())


def test_a_waiting_session_counts_as_present():
    """When b's copy lands while b waits to queue its next, b is still there: a, woken
    first, must not take a second slot meanwhile (b's next copy would queue behind two of
    a's). A cancelled wait leaves no trace and lets a have its second slot."""
    async def body():
        gate, a, b, q = CopyGate(1, 2), Session(), Session(), (3, "load")
        assert await entered(gate, a, q)
        assert await entered(gate, b, q)
        a_next = asyncio.ensure_future(gate.enter(a, q))  # woken first: it waited first
        await asyncio.sleep(0.01)
        b_next = asyncio.ensure_future(gate.enter(b, q))
        await asyncio.sleep(0.01)
        assert not a_next.done() and not b_next.done()
        gate.leave(b, q)                           # b's copy landed; b still waits
        await asyncio.sleep(0.01)
        assert b_next.done() and not a_next.done()
        b_next = asyncio.ensure_future(gate.enter(b, q))
        await asyncio.sleep(0.01)
        b_next.cancel()                            # b gives up: a is alone (b has one queued)
        await asyncio.sleep(0.01)
        assert not a_next.done()                   # b's queued copy still makes a fair
        gate.leave(b, q)
        await asyncio.sleep(0.01)
        assert a_next.done()                       # alone: its second copy
        gate.leave(a, q)
        gate.leave(a, q)
        assert gate.total == 0 and not gate.queued and not gate.waiting
    run(body())


def test_host_queue_is_the_fair_share_per_session_across_directions():
    async def body():
        gate, a, b = CopyGate(1, 4), Session(), Session()
        assert await entered(gate, a, None)
        assert not await entered(gate, a, None)    # no bonus without a named queue
        assert await entered(gate, b, None)        # per session
        gate.leave(a, None)
        gate.leave(b, None)
        assert gate.total == 0 and not gate.queued and not gate.waiting
    run(body())


@pytest.mark.parametrize("fair, alone", [(2, 1), (3, 3)])
def test_alone_below_fair_is_fair(fair, alone):
    async def body():
        gate, a = CopyGate(fair, alone), Session()
        for _ in range(fair):
            assert await entered(gate, a, (0, "store"))
        assert not await entered(gate, a, (0, "store"))
    run(body())


def test_a_cancelled_first_wait_leaves_no_entry():
    async def body():
        gate, a, q = CopyGate(1, 1), Session(), (0, "store")
        assert await entered(gate, a, q)
        assert not await entered(gate, a, q)       # cancelled while waiting
        gate.leave(a, q)
        assert gate.total == 0 and not gate.queued and not gate.waiting
    run(body())


def test_alone_small_copies_queue_up_to_the_byte_limit():
    async def body():
        gate, a, q = CopyGate(1, 2, 500), Session(), (0, "load")
        for _ in range(5):                          # two by count, three more within 500 B
            assert await entered(gate, a, q, nbytes=100)
        assert not await entered(gate, a, q, nbytes=100)
        gate.leave(a, q, 100)
        assert not await entered(gate, a, q, nbytes=200)  # 400 + 200 > 500
        assert await entered(gate, a, q, nbytes=100)
        for _ in range(5):
            gate.leave(a, q, 100)
        assert gate.total == 0 and not gate.queued and not gate.queued_bytes
    run(body())


def test_large_copies_keep_the_count_and_others_keep_the_fair_share():
    async def body():
        gate, a, b, q = CopyGate(1, 2, 500), Session(), Session(), (0, "store")
        assert await entered(gate, a, q, nbytes=300)
        assert await entered(gate, a, q, nbytes=300)  # by count
        assert not await entered(gate, a, q, nbytes=1)  # 601 > 500
        assert not await entered(gate, a, q)            # a copy of no bytes: by count only
        assert await entered(gate, b, q, nbytes=10)
        assert not await entered(gate, b, q, nbytes=10)  # a is there: fair, bytes or not
        for s, n in ((a, 300), (a, 300), (b, 10)):
            gate.leave(s, q, n)
        assert gate.total == 0 and not gate.queued and not gate.queued_bytes
    run(body())


def test_a_leave_lets_the_waiter_in_on_the_next_loop_turn():
    """Each loop turn between a copy's landing and the next copy's queuing can wait
    behind another request's work (docs/benchmarks.md in git history): the gate adds one, not two."""
    async def body():
        gate, a, q = CopyGate(1, 1), Session(), (0, "load")
        await gate.enter(a, q)
        waiter = asyncio.ensure_future(gate.enter(a, q))
        await asyncio.sleep(0)
        assert not waiter.done() and gate._wakes
        gate.leave(a, q)
        await asyncio.sleep(0)  # one turn: the waiter's wake-up ran
        assert waiter.done() and gate.total == 1 and not gate._wakes
        gate.leave(a, q)
    run(body())


def test_a_cancelled_waiter_does_not_cancel_the_others_wake():
    async def body():
        gate, a, b, q = CopyGate(1, 1), Session(), Session(), (0, "store")
        await gate.enter(a, q)
        await gate.enter(b, q)
        first = asyncio.ensure_future(gate.enter(a, q))
        second = asyncio.ensure_future(gate.enter(b, q))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0.01)
        assert first.cancelled() and not second.done()  # woken, re-checked, waits again
        gate.leave(b, q)
        await asyncio.wait_for(second, 1)
        assert gate.total == 2 and not gate.waiting
        gate.leave(a, q)
        gate.leave(b, q)
        assert gate.total == 0 and not gate.queued
    run(body())
