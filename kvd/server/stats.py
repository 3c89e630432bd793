"""Counters and op latencies of one daemon, for the control socket and /metrics.

Counters are plain ints bumped on the event loop; per op, the last ``window`` latencies
(p50/p99 at read time; stores and loads also split into phases: ``phases``) and a
fixed-bucket histogram (``LATENCY_BUCKETS_S``): the request
path pays an append, a bisect and two additions. ``scrape()`` may run on another thread:
it only copies with single C calls and reads ints. ``loop_cpu_s()`` is the event loop
thread's CPU time: near one CPU second per second, the loop queues copies late.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import Counter, defaultdict, deque

import numpy as np

# Upper bounds (seconds) of the latency buckets: 50 us to 5 s, 1-2.5-5 steps; +Inf is implied.
LATENCY_BUCKETS_S = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                     0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    """Bucket counts (``le`` semantics, the last one is +Inf) and the sum of observations."""

    __slots__ = ("counts", "sum")

    def __init__(self):
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.sum += seconds


class Stats:
    def __init__(self, window: int = 2048):
        self.counters: Counter = Counter()
        self.errors: Counter = Counter()  # (op, error code) -> failed requests
        self.moved: Counter = Counter()  # (counter name, backend) -> chunks or bytes
        self.histograms: dict[str, Histogram] = {}
        self._latency = defaultdict(lambda: deque(maxlen=window))
        self._phases = defaultdict(lambda: deque(maxlen=window))  # (op, phase) -> seconds
        self.started = time.monotonic()
        self._loop_clock = _thread_cpu_clock()

    def loop_cpu_s(self) -> float:
        """CPU seconds of the event loop's thread so far (0.0 where the OS cannot tell)."""
        if self._loop_clock is None:
            return 0.0
        try:
            return time.clock_gettime(self._loop_clock)
        except OSError:  # the thread is gone: the daemon is stopping
            return 0.0

    def add(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe(self, op: str, seconds: float) -> None:
        self._latency[op].append(seconds)
        hist = self.histograms.get(op)
        if hist is None:
            hist = self.histograms[op] = Histogram()
        hist.observe(seconds)

    def phases(self, op: str, t0: float, stamps: dict, end: float) -> None:
        """Where a store's or load's time went (``perf_counter`` stamps): ``turn`` waiting for
        its registration's earlier requests, ``engine`` for the engine's stream to reach the
        request's mark, ``copy`` the rest (pins, the copy queue, the copy)."""
        turn, mark = stamps.get("turn"), stamps.get("mark")
        if turn is None or mark is None:  # ended before it could copy: no split
            return
        for phase, seconds in (("turn", turn - t0), ("engine", mark - turn), ("copy", end - mark)):
            self._phases[(op, phase)].append(seconds)

    def phases_ms(self) -> dict:
        """``{op: {phase: {p50_ms, p99_ms}}}`` over each op's latest requests (see ``phases``)."""
        out: dict = {}
        for (op, phase), samples in self._phases.items():
            out.setdefault(op, {})[phase] = _p50_p99_ms(samples)
        return out

    def error(self, op: str, code: str) -> None:
        """A request that got an error reply (``code``: the wire error code)."""
        self.counters["errors"] += 1
        self.errors[(op, code)] += 1

    def copied(self, direction: str, backend: str, chunks: int, nbytes: int) -> None:
        """Chunks and bytes an engine stored (``direction`` "stored") or loaded ("loaded")."""
        self.counters[f"chunks_{direction}"] += chunks
        self.counters[f"bytes_{direction}"] += nbytes
        self.moved[(f"chunks_{direction}", backend)] += chunks
        self.moved[(f"bytes_{direction}", backend)] += nbytes

    def scrape(self) -> dict:
        """Copies of every counter and histogram; safe from another thread (see the docstring)."""
        hists = dict(self.histograms)
        return {"counters": dict(self.counters), "errors": dict(self.errors),
                "moved": dict(self.moved), "loop_cpu_s": self.loop_cpu_s(),
                "histograms": {op: (list(h.counts), h.sum) for op, h in hists.items()}}

    def latency_ms(self) -> dict:
        return {op: {"count": self.counters[f"op_{op}"], **_p50_p99_ms(samples)}
                for op, samples in self._latency.items()}

    def latency_histogram(self) -> dict:
        """Bucket bounds, counts and summed seconds per op (``kvd top``'s percentiles over an
        interval; the time requests of an op took over one, e.g. a benchmark's loads)."""
        return {"bounds_s": list(LATENCY_BUCKETS_S),
                "counts": {op: list(h.counts) for op, h in self.histograms.items()},
                "sum_s": {op: h.sum for op, h in self.histograms.items()}}

    def summary(self) -> dict:
        c = self.counters
        lookups = c["hit_chunks"] + c["miss_chunks"]
        return {"hits": c["hit_chunks"], "misses": c["miss_chunks"],
                "hit_rate": round(c["hit_chunks"] / lookups, 4) if lookups else 0.0,
                "bytes_stored": c["bytes_stored"], "bytes_loaded": c["bytes_loaded"],
                "chunks_stored": c["chunks_stored"], "chunks_loaded": c["chunks_loaded"],
                "store_dedup": c["store_dedup"], "foreign_ns_misses": c["foreign_ns_misses"],
                "host_corrupt_dropped": c["host_corrupt_dropped"],
                "host_verify_unsealed": c["host_verify_unsealed"],
                "errors": c["errors"], "busy": c["busy"],
                "replies_dropped": c["replies_dropped"],
                "clients_reaped": c["clients_reaped"],
                "client_files_removed": c["client_files_removed"], "uptime_s": round(time.monotonic() - self.started, 1),
                "loop_cpu_s": round(self.loop_cpu_s(), 3)}


def _thread_cpu_clock() -> int | None:
    """The calling thread's CPU-time clock (Linux and most Unixes), else None."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def _p50_p99_ms(samples) -> dict:
    """``{p50_ms, p99_ms}`` of latencies in seconds."""
    arr = np.fromiter(samples, dtype=np.float64) * 1e3
    return {"p50_ms": round(float(np.percentile(arr, 50)), 4), "p99_ms": round(float(np.percentile(arr, 99)), 4)}
