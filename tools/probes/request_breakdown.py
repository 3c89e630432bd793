#!/usr/bin/env python3
"""Where the time of one CUDA store/load request goes (run on a GPU machine).

    PYTHONPATH=$PWD/clients:$PWD python3 tools/probes/request_breakdown.py [--chunks 8] [--n 30]

One private daemon (debug log), one engine pool (Llama-3-8B shape, page 16,
chunk 256). Serial stores and loads of ``--chunks`` chunks; per op, medians
of: the client's call time; the daemon's time from receiving the request to
sending the reply (``kvd stats`` latency p50); the service's time (op
handler); the copy's enqueue and landing times (kvd.cuda.backend debug
log); and a pinned cudaMemcpy of the same bytes. The differences are the
client + ZeroMQ path, the server's parse/dispatch/reply, and the service's
own work around the copy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each request")
    p.add_argument("--spin-ms", type=float, default=0.0, help="client busy-polls for replies")
    args = p.parse_args()
    import torch

    from kvd.bench.common import control, request_bytes, start_daemon, stop_daemon
    from kvd.bench.gpu import SHAPES, make_pool, memcpy_s
    from kvd_client import KvdClient
    from kvd_client.torch_pool import CudaKVPool
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/, for daemon_timings
    from daemon_timings import summary

    shape, page, chunk = SHAPES["llama3-8b"], 16, 256
    nbytes = request_bytes(shape, args.chunks, chunk)
    ppc = chunk // page
    with tempfile.TemporaryDirectory(prefix="kvd-breakdown-") as rundir:
        log_path = Path(rundir) / "daemon.log"
        daemon = start_daemon(rundir, capacity=4 * nbytes, chunk_tokens=chunk,
                               extra=["--gpu", "on"], log_path=str(log_path))
        try:
            pool = make_pool(torch, CudaKVPool, shape, 2 * args.chunks * ppc, page)
            c = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True, heartbeat=False,
                          spin_s=args.spin_ms / 1e3).connect()
            c.register_kv(pool, model="breakdown")
            pages = list(range(args.chunks * ppc))
            other = list(range(args.chunks * ppc, 2 * args.chunks * ppc))
            times = {"store": [], "load": []}
            marks = []  # (op, client start, client end) on CLOCK_MONOTONIC
            for i in range(args.n + 2):
                tokens = np.arange(args.chunks * chunk) + i * 10**6
                torch.cuda.synchronize()
                time.sleep(args.gap_ms / 1e3)
                t0 = time.monotonic()
                c.store(tokens, pages)
                t1 = time.monotonic()
                time.sleep(args.gap_ms / 1e3)
                t1 = time.monotonic()
                c.load(tokens, other)
                t2 = time.monotonic()
                if i >= 2:
                    times["store"].append(t1 - t0)
                    times["load"].append(t2 - t1)
                    marks += [("store", t0, t1), ("load", t1, t2)]
            pings = []
            for _ in range(200):  # an empty op: client + ZeroMQ + dispatch, no work
                t0 = time.perf_counter()
                c.channel.request("heartbeat", {})
                pings.append(time.perf_counter() - t0)
            lat = control(rundir, "stats")["latency"]
            c.close()
        finally:
            stop_daemon(daemon, rundir, 60)
        memcpy = memcpy_s(torch, nbytes, 5)
        print(f"request: {args.chunks} chunks, {nbytes / 1e6:.0f} MB; memcpy d2h "
              f"{memcpy['d2h'] * 1e3:.3f} ms, h2d {memcpy['h2d'] * 1e3:.3f} ms")
        print(f"  heartbeat round trip: client {statistics.median(pings) * 1e3:.3f} ms, daemon "
              f"p50 {lat['heartbeat']['p50_ms']:.3f} ms")
        for op in ("store", "load"):
            print(f"  {op}: client call {statistics.median(times[op]) * 1e3:.3f} ms, daemon "
                  f"receive-to-reply p50 {lat[op]['p50_ms']:.3f} ms")
        summary(str(log_path))
        _timeline(log_path, marks)
    return 0


def _timeline(log_path: Path, marks: list) -> None:
    """Per op, medians of: client start -> daemon received, received -> handler started,
    handler started -> reply sent, reply sent -> client end (one clock for both)."""
    import re
    pat = re.compile(r"request (\w+): received ([\d.]+), started ([\d.]+), replied ([\d.]+)")
    seen = [(m[1], float(m[2]), float(m[3]), float(m[4]))
            for m in map(pat.search, open(log_path, errors="replace")) if m]
    parts = {}
    for op, start, end in marks:
        hit = next(((r, s, e) for o, r, s, e in seen if o == op and start <= r <= end), None)
        if hit is None:
            continue
        r, s, e = hit
        for name, v in (("client->daemon", r - start), ("queued in daemon", s - r),
                        ("handler", e - s), ("daemon->client", end - e)):
            parts.setdefault(op, {}).setdefault(name, []).append(v * 1e3)
    for op, d in parts.items():
        print(f"  {op} timeline (ms): " + ", ".join(f"{k} {statistics.median(v):.3f}"
                                                      for k, v in d.items()))


if __name__ == "__main__":
    sys.exit(main())
