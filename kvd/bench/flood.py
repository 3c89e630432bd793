"""``kvd bench --flood``: a well-behaved client's latency next to a flooding one.

A private daemon (host backend) with ``max_inflight`` at its default. A
**neighbour** client times ``--repeat`` × 40 blocking round trips (store
then load of 4 small chunks); then a **flooder** process keeps submitting
stores of fresh chunks without waiting for them (thousands unanswered) and
the neighbour times the same round trips again. Reports the neighbour's
p50 and p99 alone and flooded, their ratio, and how many of the flooder's
requests the daemon refused as ``busy``. The issue's bar: flooded p50
within 2× of alone. A benchmark, not a test.
"""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time

import numpy as np

from .common import control, start_daemon, stop_daemon

GEOMETRY = ("vllm_flash_attn", 4, 256, 16, 8, 64, "float16")  # 64 KiB per 16-token chunk


def run(args) -> int:
    from kvd_client import KvdClient, SharedKVPool
    with tempfile.TemporaryDirectory(prefix="kvd-flood-") as rundir:
        daemon = start_daemon(rundir, capacity=1 << 30, chunk_tokens=16)
        pool, client, flooder = None, None, None
        try:
            client = KvdClient(runtime_dir=rundir, timeout=30, raise_errors=True).connect()
            pool = SharedKVPool(*GEOMETRY)
            client.register_kv(pool, model="bench-flood-neighbour")
            alone = _round_trips(client, args.repeat * 40)
            ctx = multiprocessing.get_context("spawn")
            stop = ctx.Event()
            flooder = ctx.Process(target=_flood, args=(rundir, stop))
            flooder.start()
            time.sleep(1.0)  # the flood is on
            flooded = _round_trips(client, args.repeat * 40)
            stop.set()
            flooder.join(60)
            busy = control(rundir, "stats")["busy"]
        finally:
            if flooder is not None and flooder.is_alive():
                flooder.kill()
            if client is not None:
                client.close()
            if pool is not None:
                pool.close()
            stop_daemon(daemon, rundir, 30)  # and the host tier it keeps: nothing left behind
    p50a, p50f = statistics.median(alone), statistics.median(flooded)
    p99a, p99f = np.percentile(alone, 99), np.percentile(flooded, 99)
    print(f"neighbour round trip (store + load of 4 chunks of 64 KiB), {len(alone)} each:")
    print(f"  alone    p50 {p50a * 1e3:.3f} ms  p99 {p99a * 1e3:.3f} ms")
    print(f"  flooded  p50 {p50f * 1e3:.3f} ms  p99 {p99f * 1e3:.3f} ms")
    print(f"  ratio    p50 {p50f / p50a:.2f}x  p99 {p99f / p99a:.2f}x; the flooder was refused "
          f"{busy} times (busy)")
    return 0


def _round_trips(client, n: int) -> list:
    out = []
    pages, other = np.arange(4), np.arange(4, 8)
    for i in range(n):
        tokens = np.arange(64) + i * 1000
        t0 = time.perf_counter()
        client.store(tokens, pages)
        client.load(tokens, other)
        out.append(time.perf_counter() - t0)
    return out


def _flood(rundir: str, stop) -> None:
    from kvd_client import KvdClient, SharedKVPool
    client = KvdClient(runtime_dir=rundir, timeout=60).connect()
    pool = SharedKVPool(*GEOMETRY)
    client.register_kv(pool, model="bench-flood")
    fresh, inflight = 10**8, 0
    try:
        while not stop.is_set():
            while inflight < 4096 and not stop.is_set():
                client.submit_store(np.arange(256) + fresh, np.arange(16))
                fresh, inflight = fresh + 256, inflight + 1
            inflight -= len(client.poll())
    finally:
        client.close()
        pool.close()
