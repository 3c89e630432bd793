"""``kvd bench --gpu --pipeline N``: the CUDA path with requests pipelined.

``clients`` engines (threads, each with its own client, pools and stream) keep ``N``
requests in flight (``submit_store``/``submit_load`` + ``poll``); each phase (offload,
load, both ways) is compared with pinned ``cudaMemcpy`` of the same bytes measured right
before each run (PCIe rates drift between runs); the ratio is the median of per-run ratios.
Also reports the daemon's event-loop busy share (``loop_cpu_s``): near 1.0 the daemon, not
PCIe, set the rate. A benchmark, not a test.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import numpy as np

from .common import control, on_stream, page_sets, request_bytes

PHASES = ("store", "load", "both")
POOL_NAMES = {"one": "all layers in one allocation, as vLLM's",
              "per-layer": "each layer its own allocation, as SGLang's",
              "block-outer": "one allocation, a block's layers adjacent"}


def measure(torch, KvdClient, CudaKVPool, make_pool, rundir, name, shape, page, args) -> dict:
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
        engines.append((client, pool, *page_sets(args.page_order, n * ppc, c), torch.cuda.Stream()))
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
    out = {f"{phase}_{k}": float("nan") for phase in phases for k in ("Bps", "memcpy_Bps", "ratio")}
    total = clients * depth * args.pipeline_rounds * nbytes
    memcpy = _Memcpy(torch, nbytes)
    for phase, body in ((k, v) for k, v in phases.items() if k in args.pipeline_phases):
        rates, loop_busy = {"Bps": [], "memcpy_Bps": [], "ratio": []}, []
        for i in range(args.repeat + 1):
            baseline = memcpy.rate(phase, clients * depth * args.pipeline_rounds)
            leases = [client.lookup_lease(tokens, 600_000)  # fresh stores must not evict them
                      for (client, *_), tokens in zip(engines, _restore(engines, cached))]
            errors = []
            threads = [threading.Thread(target=_catching, args=(errors, body, c, e))
                       for c, e in enumerate(engines)]
            cpu_before = control(rundir, "stats")["loop_cpu_s"]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - t0
            loop_cpu = control(rundir, "stats")["loop_cpu_s"] - cpu_before
            for (client, *_), (_, lease) in zip(engines, leases):
                client.release(lease)
            if errors:
                raise errors[0]
            if i:
                for key, value in (("Bps", total / elapsed), ("memcpy_Bps", baseline),
                                   ("ratio", total / elapsed / baseline)):
                    rates[key].append(value)
                loop_busy.append(loop_cpu / elapsed)
        out.update({f"{phase}_{k}": statistics.median(v) for k, v in rates.items()})
        out[f"{phase}_ratios"], out[f"{phase}_loop_busy"] = rates["ratio"], loop_busy
    for client, *_ in engines:
        client.close()
    del engines, memcpy
    torch.cuda.empty_cache()
    return {"shape": name, "page": page, "bytes": nbytes, "clients": clients, "depth": depth,
            **out}


class _Memcpy:
    """The baseline of a phase: pinned ``cudaMemcpy`` of one request's bytes, back to
    back, device to host (store), host to device (load), or both on two streams."""

    def __init__(self, torch, nbytes: int) -> None:
        self.torch = torch
        self.dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def rate(self, phase: str, copies: int) -> float:
        """Bytes per second of ``copies`` copies (``both``: half of them each way, at once)."""
        torch, each = self.torch, copies // 2 if phase == "both" else copies
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if phase in ("store", "both"):
            with torch.cuda.stream(self.streams[0]):
                for _ in range(each):
                    self.host[0].copy_(self.dev[0], non_blocking=True)
        if phase in ("load", "both"):
            with torch.cuda.stream(self.streams[1]):
                for _ in range(each):
                    self.dev[1].copy_(self.host[1], non_blocking=True)
        torch.cuda.synchronize()
        moved = each * (2 if phase == "both" else 1) * self.dev[0].numel()
        return moved / (time.perf_counter() - t0)


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


def report(rows: list, args=None) -> None:
    if not rows:
        return
    r0 = rows[0]
    order = getattr(args, "page_order", None)
    print(f"\npipelined: {r0['clients']} engines x {r0['depth']} requests in flight "
          f"(both: half store, half load){f', {order} page ids' if order else ''}; GB/s = 1e9 B/s; "
          "ratio = median over runs of kvd GB/s / GB/s of back-to-back pinned memcpys of the same "
          "bytes right before the run")
    pools = list(dict.fromkeys(r.get("pool") for r in rows))
    for pool in pools:
        if pool is not None:
            print(f"{pool} pools ({POOL_NAMES.get(pool, pool)}):")
        print(f"{'shape':<14}{'page':>5}{'offload':>9}{'ratio':>7}{'load':>8}{'ratio':>7}"
              f"{'both':>8}{'ratio':>7}   memcpy d2h/h2d/both GB/s")
        for r in (r for r in rows if r.get("pool") == pool):
            print(f"{r['shape']:<14}{r['page']:>5}"
                  + "".join(f"{r[f'{p}_Bps'] / 1e9:>{w}.1f}{r[f'{p}_ratio']:>7.2f}"
                            for p, w in (("store", 9), ("load", 8), ("both", 8)))
                  + "   " + "/".join(f"{r[f'{p}_memcpy_Bps'] / 1e9:.1f}" for p in PHASES))
            spread = [f"{p} {min(v):.2f}-{max(v):.2f}" for p in PHASES if (v := r.get(f"{p}_ratios"))]
            print(f"{'':<19}ratio of each run: {', '.join(spread)}")
            busy = [f"{p} {statistics.median(v):.2f}" for p in PHASES if (v := r.get(f"{p}_loop_busy"))]
            if busy:
                print(f"{'':<19}daemon's event loop busy (median of the runs): {', '.join(busy)}")
