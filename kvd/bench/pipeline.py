"""``kvd bench --gpu --pipeline N``: the CUDA path with requests pipelined.

``clients`` engines (threads of this process, one ``KvdClient``, pools and
CUDA stream each: engines are separate processes in production, and on one
shared stream a store's mark would wait behind another engine's load) keep
``N`` requests of ``--chunks`` chunks in flight (``submit_store`` /
``submit_load``, collected with ``poll``) for ``N × rounds`` requests, and
the phase's bytes over its wall time is compared with the pinned
``cudaMemcpy`` rate of one request's bytes measured in the same run:
offload (every client stores fresh chunks), load (every client loads cached
chunks into other pages) and both directions at once (half the clients
store while the other half load, against both memcpys on two streams).
Medians of ``--repeat`` runs after one warm-up. A benchmark, not a test.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import numpy as np

from .common import on_stream, request_bytes

PHASES = ("store", "load", "both")


def measure(torch, KvdClient, CudaKVPool, make_pool, rundir, name, shape, page, args,
            memcpy: dict) -> dict:
    chunk, n, depth = args.chunk_tokens, args.chunks, args.pipeline
    clients = max(2, args.clients)
    ppc = chunk // page
    nbytes = request_bytes(shape, n, chunk)
    engines = []
    for c in range(clients):
        client = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True, heartbeat=False,
                           load_slots=max(64, 2 * depth)).connect()
        pool = make_pool(torch, CudaKVPool, shape, 2 * n * ppc, page, args.gpu_pool)
        client.register_kv(pool, model=f"bench-{name}")
        perm = np.random.default_rng(c).permutation(2 * n * ppc)
        engines.append((client, pool, perm[:n * ppc], perm[n * ppc:], torch.cuda.Stream()))
    cached = [np.arange(n * chunk) + 7 * 10**8 + c * n * chunk for c in range(clients)]
    torch.cuda.synchronize()
    fresh = itertools.count(10**9, n * chunk)  # next() on it is atomic: threads share it
    phases = {"store": lambda c, e: _run(e, "store", depth, args.pipeline_rounds, fresh, n, chunk),
              "load": lambda c, e: _run(e, "load", depth, args.pipeline_rounds, None, n, chunk,
                                        cached[c]),
              "both": lambda c, e: (_run(e, "store", depth, args.pipeline_rounds, fresh, n, chunk)
                                    if c % 2 == 0 else
                                    _run(e, "load", depth, args.pipeline_rounds, None, n, chunk,
                                         cached[c]))}
    out = {phase: float("nan") for phase in phases}
    for phase, body in ((k, v) for k, v in phases.items() if k in args.pipeline_phases):
        times = []
        for i in range(args.repeat + 1):
            leases = [client.lookup_lease(tokens, 600_000)  # fresh stores must not evict them
                      for (client, *_), tokens in zip(engines, _restore(engines, cached))]
            errors = []
            threads = [threading.Thread(target=_catching, args=(errors, body, c, e))
                       for c, e in enumerate(engines)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - t0
            for (client, *_), (_, lease) in zip(engines, leases):
                client.release(lease)
            if errors:
                raise errors[0]
            if i:
                times.append(elapsed)
        total = clients * depth * args.pipeline_rounds * nbytes
        out[phase] = total / statistics.median(times)
    for client, *_ in engines:
        client.close()
    del engines
    torch.cuda.empty_cache()
    return {"shape": name, "page": page, "bytes": nbytes, "clients": clients, "depth": depth,
            "store_Bps": out["store"], "load_Bps": out["load"], "both_Bps": out["both"],
            "memcpy_d2h_Bps": nbytes / memcpy["d2h"], "memcpy_h2d_Bps": nbytes / memcpy["h2d"],
            "memcpy_both_Bps": 2 * nbytes / memcpy["both"]}


def _restore(engines: list, cached: list) -> list:
    """Store each client's cached prompt again where the previous phase evicted it."""
    for (client, _, src, *_), tokens in zip(engines, cached):
        client.store(tokens, src)
    return cached


def _catching(errors: list, body, *args) -> None:
    try:
        body(*args)
    except BaseException as exc:  # noqa: BLE001 - re-raised by the timing thread
        errors.append(exc)


def _run(engine, op: str, depth: int, rounds: int, fresh, n: int, chunk: int, tokens=None) -> None:
    """``depth × rounds`` requests of one engine with ``depth`` in flight, marked on and
    waited for on the engine's own stream."""
    import torch
    client, _, src, dst, stream = engine
    on_stream(torch, stream, _keep_in_flight, client, op, src if op == "store" else dst,
              depth * rounds, depth, fresh, n, chunk, tokens)


def _keep_in_flight(client, op: str, pages, todo: int, depth: int, fresh, n: int, chunk: int,
                    tokens) -> None:
    inflight = 0
    while todo or inflight:
        while todo and inflight < depth:
            if op == "store":
                t = client.submit_store(np.arange(n * chunk) + next(fresh), pages)
            else:
                t = client.submit_load(tokens, pages)
            todo, inflight = todo - 1, inflight + 1
        for t in client.poll():
            inflight -= 1
            if not t.ok or t.tokens != n * chunk:
                raise RuntimeError(f"a pipelined {t.op} failed: {t}")
        if inflight >= depth or not todo:
            client.progress(None, 0.001)


def report(rows: list) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"\npipelined: {r0['clients']} clients x {r0['depth']} requests in flight "
          f"(both: half store, half load); ratio = kvd GB/s / memcpy GB/s in the same run")
    print(f"{'shape':<14}{'page':>5}{'offload':>9}{'ratio':>7}{'load':>8}{'ratio':>7}"
          f"{'both':>8}{'ratio':>7}")
    for r in rows:
        print(f"{r['shape']:<14}{r['page']:>5}"
              f"{r['store_Bps'] / 1e9:>9.1f}{r['store_Bps'] / r['memcpy_d2h_Bps']:>7.2f}"
              f"{r['load_Bps'] / 1e9:>8.1f}{r['load_Bps'] / r['memcpy_h2d_Bps']:>7.2f}"
              f"{r['both_Bps'] / 1e9:>8.1f}{r['both_Bps'] / r['memcpy_both_Bps']:>7.2f}")
