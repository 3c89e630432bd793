"""Progress of long start-up work: percent, rate and time left, at most every ``every_s``.

``Progress(total, unit)`` follows work measured in bytes (``unit="bytes"``:
shown in GiB, GiB/s) or in counted items (``unit="files"``). ``due()``
says whether a report is owed (the first after ``every_s``, then every
``every_s``); ``report(done)`` marks one given and returns the line and its
fields (for JSON logs and ``kvd stats``): ``42% (3.4 of 8.0 GiB), 2.1 GiB/s,
about 2 s left``.
"""

from __future__ import annotations

import time

PROGRESS_S = 1.0


class Progress:
    def __init__(self, total: int, unit: str = "bytes", every_s: float = PROGRESS_S):
        self.total = max(int(total), 0)
        self.unit = unit
        self.every_s = every_s
        self.started = self._last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.every_s

    def fields(self, done: int) -> dict:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = done / elapsed
        left = (self.total - done) / rate if rate > 0 else None
        return {"done": done, "total": self.total,
                "percent": round(100 * done / self.total, 1) if self.total else 100.0,
                "rate_per_s": round(rate, 1), "eta_s": None if left is None else round(left, 1)}

    def report(self, done: int) -> tuple[str, dict]:
        self._last = time.monotonic()
        f = self.fields(done)
        eta = "?" if f["eta_s"] is None else f"{f['eta_s']:.0f} s"
        if self.unit == "bytes":
            g = 2**30
            text = (f"{f['percent']:.0f}% ({done / g:.1f} of {self.total / g:.1f} GiB), "
                    f"{f['rate_per_s'] / g:.2f} GiB/s, about {eta} left")
        else:
            text = (f"{f['percent']:.0f}% ({done} of {self.total} {self.unit}), "
                    f"{f['rate_per_s']:.0f} {self.unit}/s, about {eta} left")
        return text, f
