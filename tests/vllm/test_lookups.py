"""The scheduler's lookups never block a step: vLLM's "not determined yet" (None) answer.

Real daemon, real clients (tests/vllm/halves.py). ``matched`` sends the
lookup and waits at most the step's ``lookup_wait_ms``; without a reply yet
it answers None and vLLM asks again in a later step. A frozen daemon
(SIGSTOP) therefore costs no step more than that wait: the request gets a
miss at ``timeout_s``, later requests miss at once until the daemon answers
again, and leases that come after nobody wants them are released.
"""

from __future__ import annotations

import time

from daemons import wait_for
from halves import Request, frozen, step_output, store_prompt

TOKENS = list(range(7, 60))  # 53 tokens: kvd may offer 3 chunks (48 tokens), one is computed
HIT = (48, True)             # 48 tokens, loaded asynchronously (async_load_min_tokens 32)


def timed_matched(engine, req, local: int = 0):
    """``matched`` and the seconds it took."""
    start = time.monotonic()
    answer = engine.sched.matched(req, local)
    return answer, time.monotonic() - start


def answered(engine, req, timeout: float = 5.0):
    """Ask as vLLM does: once per step until the answer is not None; (answer, calls, each
    call's seconds)."""
    took = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer, seconds = timed_matched(engine, req)
        took.append(seconds)
        engine.sched.step(step_output())  # the step ends: the next one has its own wait
        if answer[0] is not None:
            return answer, took
        time.sleep(0.005)                 # the rest of the step
    raise AssertionError(f"no answer for {req.request_id} within {timeout} s")


def stored(make):
    a = make()
    store_prompt(a, "r1", TOKENS, list(range(1, 15)))
    return a


def test_a_quick_daemon_answers_on_the_first_call(engines):
    daemon, make = engines
    stored(make)
    quick = make(lookup_wait_ms=500.0)
    answer, seconds = timed_matched(quick, Request("r2", TOKENS))
    assert answer == HIT and seconds < 0.5            # the reply came within the wait
    # vLLM asks again (no blocks this step): the leased answer stands, no second lookup
    assert quick.sched.matched(quick.sched.reqs["r2"].request, 0) == HIT
    assert quick.counters.take()["lookups"] == 1
    # never waiting: the first call sends the lookup, a later one reads the reply
    lazy = make(lookup_wait_ms=0.0)
    req = Request("r3", TOKENS)
    with frozen(daemon):  # no reply can beat the first call's read, however the OS schedules
        t0 = time.monotonic()
        assert lazy.sched.matched(req, 0) == (None, False)
        assert time.monotonic() - t0 < 0.05
    answer, took = answered(lazy, req)
    assert answer == HIT and max(took) < 0.05
    assert lazy.counters.take()["lookups"] == 1       # one lookup, however often asked
    for e, r in ((quick, "r2"), (lazy, "r3")):
        e.sched.finished(e.sched.reqs[r].request, [])
    wait_for(lambda: daemon.stats()["leases"] == 0, 5, "the leases' release")


def test_an_answer_older_than_half_its_lease_is_asked_again(engines):
    _, make = engines
    stored(make)
    e = make(lease_ms=200)
    req = Request("r2", TOKENS)
    assert e.sched.matched(req, 0) == HIT
    time.sleep(0.15)                                  # the lease may lapse before a load
    assert answered(e, req)[0] == HIT
    assert e.counters.take()["lookups"] == 2


def test_a_frozen_daemon_never_stalls_a_step(engines):
    daemon, make = engines
    stored(make)
    b = make(timeout_s=0.5, lookup_wait_ms=2.0)
    hits = daemon.stats()["hits"]
    with frozen(daemon):
        start = time.monotonic()
        answer, took = answered(b, Request("r2", TOKENS))
        assert answer == (0, False)                   # no reply by timeout_s: a miss
        assert 0.5 <= time.monotonic() - start < 2.0
        assert len(took) > 10 and max(took) < 0.05    # no step waited for it
        # the daemon has not answered since: later lookups miss at once
        answer, seconds = timed_matched(b, Request("r3", TOKENS))
        assert answer == (0, False) and seconds < 0.02
    # thawed: the late reply comes (its lease is released at once), lookups hit again
    wait_for(lambda: not b.sc.lookups_unanswered, 5, "the daemon's late reply")
    late = Request("r4", TOKENS)
    assert answered(b, late)[0] == HIT
    wait_for(lambda: daemon.stats()["hits"] == hits + 6, 5, "both lookups")  # r2's and r4's
    wait_for(lambda: daemon.stats()["leases"] == 1, 5, "r2's late lease to go")
    b.sched.finished(late, [])
    wait_for(lambda: daemon.stats()["leases"] == 0, 5, "r4's lease to go")
    assert b.counters.take()["lookups"] == 3


def test_requests_of_one_step_share_its_wait(engines):
    daemon, make = engines
    stored(make)
    b = make(lookup_wait_ms=100.0)
    first, second = Request("r2", TOKENS), Request("r3", TOKENS)
    with frozen(daemon):
        answer, seconds = timed_matched(b, first)
        assert answer == (None, False) and 0.1 <= seconds < 0.3
        answer, seconds = timed_matched(b, second)
        assert answer == (None, False) and seconds < 0.02  # the step's wait is spent
        b.sched.step(step_output())
        answer, seconds = timed_matched(b, second)
        assert answer == (None, False) and 0.1 <= seconds < 0.3  # a new step, a new wait
    assert [answered(b, r)[0] for r in (first, second)] == [HIT, HIT]


def test_a_request_that_ends_with_its_lookup_out_leaves_no_lease(engines):
    daemon, make = engines
    stored(make)
    b = make(lookup_wait_ms=0.0)
    gone, kept = Request("r2", TOKENS), Request("r3", TOKENS)
    hits = daemon.stats()["hits"]
    with frozen(daemon):                              # both lookups wait in the daemon
        assert b.sched.matched(gone, 0) == (None, False)
        assert b.sched.matched(kept, 0) == (None, False)
        assert b.sched.finished(gone, []) is False and "r2" not in b.sched.reqs
    wait_for(lambda: daemon.stats()["hits"] == hits + 6, 5, "both lookups")
    wait_for(lambda: daemon.stats()["leases"] == 1, 5, "the ended request's lease to go")
    time.sleep(0.2)
    assert daemon.stats()["leases"] == 1              # the kept request's lease stays
    assert answered(b, kept)[0] == HIT
    b.sched.finished(kept, [])
    wait_for(lambda: daemon.stats()["leases"] == 0, 5, "the kept request's lease to go")


def test_without_a_daemon_lookups_miss_at_once(engines):
    daemon, make = engines
    b = make()
    daemon.stop()
    req = Request("r2", TOKENS)
    for _ in range(3):  # vLLM asks again (no blocks yet): the miss stands, nothing is resent
        answer, seconds = timed_matched(b, req)
        assert answer == (0, False) and seconds < 0.1
    answer, seconds = timed_matched(b, Request("r3", TOKENS))
    assert answer == (0, False) and seconds < 0.1
    assert b.counters.take()["lookups"] == 2
