"""``kvd bench`` (default): store and load through the host backend.

Starts a private daemon, registers a shared-memory pool, and times
end-to-end ``store`` (engine pages -> host tier) and ``load`` (host tier ->
other pages) of the same chunks, each next to a plain numpy copy of the
same number of bytes measured in the same run. Medians of ``--repeat`` runs.
With ``--scrape-hz`` the daemon serves /metrics and another process scrapes
it that often meanwhile (the request path must not notice). With
``--verify-loads`` the daemon runs with ``verify_loads = on`` and each load
waits until the chunks just stored have their checksums (a chunk without
one is trusted, which would time no verification).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np

from kvd_protocol.keys import DTYPE_SIZES

from .common import control, free_port, start_daemon, start_scraper, stop_daemon, write_json


def run(args) -> int:
    from kvd_client import KvdClient, SharedKVPool

    row = args.kv_heads * args.head_dim * DTYPE_SIZES[args.dtype]
    planes = 1 if args.layout.endswith("mla") else 2
    shard = args.layers * planes * args.chunk_tokens * row
    nbytes = shard * args.chunks
    ppc = args.chunk_tokens // args.page_size
    pages = 2 * args.chunks * ppc
    print(f"kvd bench: {args.layout}, {args.layers} layers, row {row} B, page {args.page_size} tokens, "
          f"{args.chunks} chunks of {shard / 2**20:.1f} MiB = {nbytes / 2**20:.0f} MiB per request",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as rundir:
        port = free_port() if args.scrape_hz else 0
        daemon = start_daemon(rundir, capacity=int(nbytes * 2.5) + 2**20, chunk_tokens=args.chunk_tokens,
                              log_path=args.daemon_log, profile=args.daemon_profile,
                              extra=("--metrics-port", str(port),
                                     "--verify-loads", "on" if args.verify_loads else "off"))
        scraper = start_scraper(port, args.scrape_hz) if port else None
        pool = None
        try:
            client = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True, heartbeat=False).connect()
            pool = SharedKVPool(args.layout, args.layers, pages, args.page_size, args.kv_heads,
                                args.head_dim, args.dtype)
            pool.raw[:] = np.random.default_rng(0).integers(0, 256, pool.raw.size, dtype=np.uint8)
            client.register_kv(pool, model="kvd-bench")
            sealed = (lambda: _wait_sealed(rundir)) if args.verify_loads else (lambda: None)
            results = _measure(client, args, ppc, nbytes, sealed)
            client.close()
        finally:
            if pool is not None:
                pool.close()
            if scraper is not None:
                scraper.terminate()
                print(f"scraper: {scraper.communicate(timeout=10)[0].strip()} scrapes of /metrics at "
                      f"{args.scrape_hz:g} Hz meanwhile")
            stop_daemon(daemon, rundir, 30)
    _report(results, nbytes)
    if args.plot:
        _plot(args, results, nbytes)
    if args.json:
        from .plot import machine
        write_json(args.json, machine=machine(), bytes=nbytes, verify_loads=args.verify_loads,
                   seconds=results)  # each timed run (the warm-up left out), by what was timed
    return 0


def _wait_sealed(rundir: str, timeout: float = 60.0) -> None:
    """Until every stored chunk has its checksum (they are computed once copies pause)."""
    deadline = time.monotonic() + timeout
    while control(rundir, "stats")["tiers"]["host"]["warm"]["unsealed_shards"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the stored chunks' checksums did not come")
        time.sleep(0.01)


def _measure(client, args, ppc: int, nbytes: int, sealed) -> dict:
    src_pages = np.arange(args.chunks * ppc)
    dst_pages = src_pages + args.chunks * ppc
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    out = {"store": [], "load": [], "numpy copy": []}
    for i in range(args.repeat + 1):  # the first run warms up and is dropped
        tokens = np.arange(args.chunks * args.chunk_tokens) + i * 10**6
        t0 = time.perf_counter()
        stored = client.store(tokens, src_pages)
        t1 = time.perf_counter()
        sealed()
        t1a = time.perf_counter()  # the load's clock starts here: the wait is not its time
        loaded = client.load(tokens, dst_pages)
        t2 = time.perf_counter()
        np.copyto(b, a)
        t3 = time.perf_counter()
        if stored != len(tokens) or loaded != len(tokens):
            raise RuntimeError(f"stored {stored} and loaded {loaded} of {len(tokens)} tokens")
        if i:
            out["store"].append(t1 - t0)
            out["load"].append(t2 - t1a)
            out["numpy copy"].append(t3 - t2)
        print(f"  run {i}{' (warm-up)' if not i else ''}: store {nbytes / (t1 - t0) / 1e9:.2f} GB/s, "
              f"load {nbytes / (t2 - t1a) / 1e9:.2f} GB/s, numpy {nbytes / (t3 - t2) / 1e9:.2f} GB/s",
              flush=True)
    return out


def _plot(args, results: dict, nbytes: int) -> None:
    from .plot import bars, command, machine
    names = list(results)
    gbps = [nbytes / statistics.median(results[n]) / 1e9 for n in names]
    bars(args.plot, f"kvd bench (host backend): {nbytes / 2**20:.0f} MiB per request, median of "
         f"{args.repeat}", names, {"GB/s": gbps}, "GB/s", f"{machine()}; {command()}")
    print(f"plot: {args.plot}")


def _report(results: dict, nbytes: int) -> None:
    base = statistics.median(results["numpy copy"])
    print(f"\n{'what':<12}{'median ms':>11}{'GB/s':>9}{'vs numpy copy':>15}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:<12}{med * 1e3:>11.2f}{nbytes / med / 1e9:>9.2f}{base / med:>14.0%}")
