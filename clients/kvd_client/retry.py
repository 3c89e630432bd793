"""What the client does when a request fails for a reason a retry can fix.

``Retry(attempts, backoff_s)``: when the daemon answers ``no_session`` (it
restarted, or reaped this client), the client says hello again, registers
its pools again and resends the request, up to ``attempts`` times, sleeping
``backoff_s × 2**k`` before resend ``k``. Other failures are not retried:
a cache miss is cheaper than a stalled engine. Pass ``Retry(0)`` to never
resend; the default, ``Retry()``, resends once at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Retry:
    attempts: int = 1
    backoff_s: float = 0.0

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.backoff_s < 0:
            raise ValueError("attempts and backoff_s must be >= 0")

    def delay(self, attempt: int) -> float:
        """Seconds to sleep before resend number ``attempt`` (0-based)."""
        return self.backoff_s * (2 ** attempt)
