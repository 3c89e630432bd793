"""A circuit breaker: after repeated failures, stop calling a remote store for a while.

States: ``closed`` (calls go through), ``open`` (calls are refused at once,
nothing waits on the store) and ``probing`` (one probe is out; calls are
still refused). ``failures`` consecutive failures (errors or timeouts) open
it; a success resets the count. While open, ``probe_due()`` turns true once
``retry_s`` passed: the caller sends one probe (never a request's call) and
reports it with ``success()`` (closed) or ``failure()`` (open for another
``retry_s``); calls that finish while it is open change nothing. A
breaker starts open with a probe due: nothing is called before the store
answered once. Loop-only: no locks.
"""

from __future__ import annotations

import time


class Breaker:
    def __init__(self, failures: int, retry_s: float, clock=time.monotonic):
        self.threshold = failures
        self.retry_s = retry_s
        self.clock = clock
        self.state = "open"
        self.failures = 0
        self.opened = 0       # times it opened (the first, at start, not counted)
        self.retry_at = clock()

    def allow(self) -> bool:
        return self.state == "closed"

    def probe_due(self) -> bool:
        """True (and the state becomes ``probing``) when an open breaker should probe now."""
        if self.state == "open" and self.clock() >= self.retry_at:
            self.state = "probing"
            return True
        return False

    def success(self) -> None:
        """A call or the probe succeeded; an open breaker stays open (only its probe closes it:
        a late answer to a call sent before it opened says nothing about now)."""
        if self.state != "open":
            self.state = "closed"
            self.failures = 0

    def failure(self) -> bool:
        """Count a failure; True when this one opened the breaker."""
        self.failures += 1
        if self.state == "probing" or (self.state == "closed" and self.failures >= self.threshold):
            opening = self.state == "closed"
            self.state = "open"
            self.retry_at = self.clock() + self.retry_s
            self.opened += opening
            return opening
        return False
