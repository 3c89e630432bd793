"""Counters and op latencies of one daemon, for the control socket.

Counters are plain integers bumped on the event loop. Latencies keep the
last ``window`` samples per op; p50/p99 are computed when stats are read,
so the request path pays one deque append.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque

import numpy as np


class Stats:
    def __init__(self, window: int = 2048):
        self.counters: Counter = Counter()
        self._latency = defaultdict(lambda: deque(maxlen=window))
        self.started = time.monotonic()

    def add(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe(self, op: str, seconds: float) -> None:
        self._latency[op].append(seconds)

    def latency_ms(self) -> dict:
        out = {}
        for op, samples in self._latency.items():
            arr = np.fromiter(samples, dtype=np.float64) * 1e3
            out[op] = {"count": self.counters[f"op_{op}"], "p50_ms": round(float(np.percentile(arr, 50)), 4),
                       "p99_ms": round(float(np.percentile(arr, 99)), 4)}
        return out

    def summary(self) -> dict:
        c = self.counters
        lookups = c["hit_chunks"] + c["miss_chunks"]
        return {"hits": c["hit_chunks"], "misses": c["miss_chunks"],
                "hit_rate": round(c["hit_chunks"] / lookups, 4) if lookups else 0.0,
                "bytes_stored": c["bytes_stored"], "bytes_loaded": c["bytes_loaded"],
                "chunks_stored": c["chunks_stored"], "chunks_loaded": c["chunks_loaded"],
                "store_dedup": c["store_dedup"], "errors": c["errors"], "busy": c["busy"],
                "replies_dropped": c["replies_dropped"],
                "clients_reaped": c["clients_reaped"], "uptime_s": round(time.monotonic() - self.started, 1)}
