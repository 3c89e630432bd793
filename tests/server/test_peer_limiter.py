"""kvd.server.logs.PeerLimiter: one line per peer per interval, held-back counts, bounded
memory (no daemon)."""

from __future__ import annotations

import logging

from kvd.server.logs import OTHERS, PeerLimiter


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_peer_per_interval():
    clock = Clock()
    limit = PeerLimiter(10.0, clock=clock)
    assert limit.allow("a") == 0
    assert [limit.allow("a") for _ in range(1000)] == [None] * 1000
    assert limit.allow("b") == 0  # another peer has its own allowance
    clock.now = 10.0
    assert limit.allow("a") == 1000  # the next line says how many were held back
    assert limit.allow("a") is None


def test_memory_is_bounded_by_max_peers():
    clock = Clock()
    limit = PeerLimiter(10.0, max_peers=4, clock=clock)
    assert [limit.allow(i) for i in range(4)] == [0] * 4
    assert limit.allow(4) == 0 and limit.allow(5) is None  # full: new peers share one line
    assert len(limit._peers) == 5 and OTHERS in limit._peers
    clock.now = 11.0
    assert [limit.allow(i) for i in range(100, 104)] == [0] * 4  # expired peers forgotten
    assert [limit.allow(i) for i in range(200, 300)].count(0) <= 2  # full again: shared
    assert len(limit._peers) <= 5


def test_log_appends_the_held_back_count(caplog):
    clock = Clock()
    limit = PeerLimiter(10.0, clock=clock)
    log = logging.getLogger("kvd.test")
    with caplog.at_level(logging.INFO, "kvd.test"):
        for _ in range(3):
            limit.log(log, logging.WARNING, "p", "bad from %s", "p")
        clock.now = 20.0
        limit.log(log, logging.WARNING, "p", "bad from %s", "p")
    assert [r.getMessage() for r in caplog.records] == ["bad from p",
                                                        "bad from p (2 more like it held back)"]


def test_a_burst_per_interval_and_a_summary_of_what_was_held_back(caplog):
    clock = Clock()
    limit = PeerLimiter(10.0, clock=clock, burst=4)
    assert [limit.allow((0, 7)) for _ in range(6)] == [0, 0, 0, 0, None, None]
    assert limit.allow((0, 7), burst=1) is None  # a kind of line allowed less often
    assert [limit.allow((0, 8), burst=1) for _ in range(3)] == [0, None, None]
    log = logging.getLogger("kvd.test")
    with caplog.at_level(logging.INFO, "kvd.test"):
        clock.now = 10.0
        limit.summary(log)
        limit.summary(log)  # nothing held back since: no line
    assert [r.getMessage() for r in caplog.records] == [
        "held back 5 log lines about peers in the last 10 s (uid 0 pid 7: 3, uid 0 pid 8: 2)"]
