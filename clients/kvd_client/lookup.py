"""A lookup in flight: what ``KvdClient.submit_lookup`` returns.

``Lookup`` asks for the longest cached prefix (pinned under a lease) without waiting; its
reply is routed by the pump. ``poll()`` never waits, ``wait(timeout)`` drives the client;
``result()`` returns ``(tokens, lease)`` (with ``part_tokens``, a partial entry found past a
whole prefix counts too; ``part`` says which): unavailability is a miss ``(0, None)``, a
contract error raises. Answered ``no_session``, it is resent after hello per ``Retry``.
Promises: no lookup leaks a lease (a late reply's lease is released at once); a lookup
past its deadline marks the daemon as not answering: a hung daemon costs one deadline.
"""

from __future__ import annotations

import time

from kvd_protocol.errors import NoSession, Timeout


class Lookup:
    def __init__(self, client, reg, keys: list[bytes], lease_ms: int, deadline: float,
                 part_tokens: list[int] | None = None):
        self._client = client
        self.reg = reg
        self.keys, self.lease_ms = keys, lease_ms
        self.deadline = deadline        # CLOCK_MONOTONIC seconds
        self.forget_at = deadline + lease_ms / 1e3  # abandoned: the longest its reply is awaited
        self.hits = 0                   # chunks found
        self.disk_hits = self.remote_hits = 0  # of them, on the disk tier / the remote tier
        self.lease: int | None = None
        self.error: Exception | None = None
        self.answered_at: float | None = None
        self.sent_under = 0             # the client's hello count when sent (Pump.session_lost)
        self.attempts = 0               # resends after no_session (the client's Retry)
        self.resend_at: float | None = None
        self.done = False
        self.abandoned = False          # nobody reads it: a lease that comes is released
        self._taken = False             # result() handed the lease to the caller
        self.part_tokens = part_tokens  # the last keys are partial keys of these tokens (§8.5)
        self.part: int | None = None    # tokens of the partial entry found past the hits

    @property
    def tokens(self) -> int:
        return self.hits * self.reg.namespace.chunk_tokens + (self.part or 0)

    def poll(self) -> bool:
        """Whether it is done, collecting replies that arrived; never waits."""
        return self.wait(0.0)

    def wait(self, timeout: float | None = None) -> bool:
        """Drive the client until it is done, ``timeout`` passed or its deadline did."""
        end = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        while not self.done:
            if self.resend_at is not None and time.monotonic() >= self.resend_at:
                self.resend_at = None
                self._client._pump.start_lookup(self)
                continue
            self._client.progress(None, max(0.0, end - time.monotonic()))
            if time.monotonic() >= end:
                break
        if not self.done and time.monotonic() >= self.deadline:
            with self._client._lock:
                self.expire()
        return self.done

    def result(self) -> tuple[int, int | None]:
        """``(tokens, lease)`` once done (waits until then); a miss when it failed."""
        self.wait()
        self._taken = True
        return self._client._guard(self._answer, (0, None))

    def cancel(self) -> None:
        """The caller will not read it: its lease, now or when it comes, is released."""
        with self._client._lock:
            if self.abandoned or self._taken:
                return
            self.abandoned = True
            self._stray(self.lease)

    def _answer(self) -> tuple[int, int | None]:
        if self.error is not None:
            raise self.error
        return self.tokens, self.lease

    # ---- state changes (the client's lock is held) -----------------------------------

    def resolve(self, result, error) -> None:
        """The reply (or the pump's failure), routed by the pump."""
        lease = None if result is None else result.get("lease")
        if self.done:  # past its deadline: only its lease matters now
            self._stray(lease)
            return
        if isinstance(error, NoSession):  # the daemon restarted or reaped us: hello next
            self._client._pump.session_lost(self.sent_under)
            retry = self._client.retry
            if self.attempts < retry.attempts and not self.abandoned:
                self.resend_at = time.monotonic() + retry.delay(self.attempts)  # by wait()
                self.attempts += 1
                return
        self.error, self.answered_at = error, time.monotonic()
        if error is None:
            self.hits, self.lease, self.part = result["hits"], lease, result.get("part")
            self.disk_hits, self.remote_hits = result.get("disk_hits", 0), result.get("remote_hits", 0)
        if self.abandoned:
            self._stray(self.lease)
        self.done = True

    def expire(self) -> None:
        """Past its deadline, unanswered: a miss; a reply that still comes is not read."""
        if self.done:
            return
        self.error = Timeout(f"kvd did not answer the lookup within {self._client.timeout:g} s")
        self.abandoned = self.done = True
        self._client.lookups_unanswered = True

    def _stray(self, lease: int | None) -> None:
        if lease is not None:
            self._client._stray_leases.append(lease)
