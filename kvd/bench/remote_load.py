"""``kvd bench --remote``, end to end: a load whose prefix is half local, half remote.

Two private daemons share one store: A stores and publishes prefixes; B, with no lookup
first (every fetch happens inside the load), times ``local`` (host hits), ``remote``
(every chunk fetched) and ``mixed`` (half each). ``mixed`` near the max of the halves means
local copies and fetches overlap; near their sum, they run one after the other.
``run`` returns every run's times per store (for ``--json``). Asserts nothing about speed.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

from kvd_protocol.keys import DTYPE_SIZES

from .common import control, start_daemon, stop_daemon
from .stores import MooncakeMaster, RedisServer, mooncake_env

SERVERS = {"redis": RedisServer, "mooncake": MooncakeMaster}


def run(args) -> dict:
    """{store: {"local"|"remote"|"mixed": [seconds of each run], "chunk_bytes": n}}."""
    out = {}
    for name in args.remote_stores.split(","):
        why = SERVERS[name].missing()
        if why:
            print(f"\nhalf-local, half-remote load ({name}): skipped: {why}")
            continue
        out[name] = _store(args, name)
    return out


def _store(args, name: str) -> dict:
    half = max(1, args.chunks // 2)
    row = args.kv_heads * args.head_dim * DTYPE_SIZES[args.dtype]
    shard = args.layers * (1 if args.layout.endswith("mla") else 2) * args.chunk_tokens * row
    server = SERVERS[name]().start()
    try:
        with tempfile.TemporaryDirectory(prefix="kvd-bench-remote-") as tmp:
            capacity = 3 * half * shard * (args.repeat + 1) + (64 << 20)
            times = _runs(args, _knobs(server, name, capacity), capacity, tmp, half)
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    total, most = med["local"] + med["remote"], max(med["local"], med["remote"])
    print(f"\nhalf-local, half-remote load ({name}, loopback): {half} + {half} chunks of "
          f"{shard / 2**20:.1f} MiB, no lookup first, median of {args.repeat}")
    print(f"{'load':<28}{'median ms':>11}")
    for key, label in (("local", "local half alone"), ("remote", "remote half alone"),
                       ("mixed", "half local + half remote")):
        print(f"{label:<28}{med[key] * 1e3:>11.2f}")
    print(f"{'sum of the halves':<28}{total * 1e3:>11.2f}")
    print(f"{'max of the halves':<28}{most * 1e3:>11.2f}")
    print(f"mixed / sum {med['mixed'] / total:.2f}, mixed / max {med['mixed'] / most:.2f}",
          flush=True)
    return {**times, "chunk_bytes": shard, "chunks_per_half": half}


def _knobs(server, name: str, capacity: int) -> list:
    # a loaded 2-core VM can take longer than the default 0.1 s for an 8 MiB value
    knobs = ["--remote-backend", name, "--remote-prefix", "bench", "--remote-timeout-s", "2"]
    if name == "redis":
        return knobs + ["--remote-address", server.url]
    os.environ.update(mooncake_env())  # the daemons inherit it; each lends half the values' room
    return knobs + ["--remote-address", server.address, "--remote-mooncake-metadata",
                    server.metadata, "--remote-mooncake-local-host", "127.0.0.1",
                    "--remote-mooncake-segment-bytes", str(capacity // 2 + (64 << 20))]


def _runs(args, knobs: list, capacity: int, tmp: str, half: int) -> dict:
    dirs = [f"{tmp}/a", f"{tmp}/b"]
    procs = []
    try:
        for d in dirs:
            procs.append(start_daemon(d, capacity, args.chunk_tokens, knobs))
        for d in dirs:
            _wait(lambda: control(d, "stats")["tiers"]["remote"]["breaker"] == "closed", d)
        return _measure(args, dirs, half)
    finally:
        for proc, d in zip(procs, dirs):
            stop_daemon(proc, d, 30)


def _wait(ok, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(0.02)


def _measure(args, dirs: list, half: int) -> dict:
    from kvd_client import KvdClient, SharedKVPool
    ppc = args.chunk_tokens // args.page_size
    pool = SharedKVPool(args.layout, args.layers, 4 * half * ppc, args.page_size, args.kv_heads,
                        args.head_dim, args.dtype)
    pool.raw[:] = np.random.default_rng(0).integers(0, 256, pool.raw.size, dtype=np.uint8)
    clients = [KvdClient(runtime_dir=d, timeout=120, raise_errors=True, heartbeat=False).connect()
               for d in dirs]
    out: dict = {"local": [], "remote": [], "mixed": []}
    try:
        for c in clients:
            c.register_kv(pool, model="kvd-bench-remote")
        a, b = clients
        src, dst = np.arange(2 * half * ppc), np.arange(2 * half * ppc, 4 * half * ppc)
        for r in range(args.repeat):
            s = np.arange(2 * half * args.chunk_tokens) + (2 * r + 1) * 10**7
            t = np.arange(half * args.chunk_tokens) + (2 * r + 2) * 10**7
            head = s[:half * args.chunk_tokens]
            a.store(s, src)
            a.store(t, src[:half * ppc])
            want = 3 * half * (r + 1)
            _wait(lambda: control(dirs[0], "stats")["tiers"]["remote"]["puts"] >= want, "A's puts")
            b.lookup(head)
            b.load(head, dst[:half * ppc])  # the local half, from now on
            for name in ("remote", "mixed") if r % 2 == 0 else ("mixed", "remote"):
                tokens = t if name == "remote" else s
                out[name].append(_timed(b, tokens, dst, len(tokens) // args.chunk_tokens * ppc))
            out["local"].append(_timed(b, head, dst, half * ppc))
            print(f"  run {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in out.items()),
                  flush=True)
    finally:
        for c in clients:
            c.close()
        pool.close()
    return out


def _timed(client, tokens, pages, n_pages: int) -> float:
    t0 = time.perf_counter()
    loaded = client.load(tokens, pages[:n_pages])
    took = time.perf_counter() - t0
    if loaded != len(tokens):
        raise RuntimeError(f"loaded {loaded} of {len(tokens)} tokens")
    return took
