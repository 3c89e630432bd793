"""Per-request cost of lookup, store and load against the number of keys in one request.

Starts a private daemon (host backend) that accepts up to the largest count asked for,
registers a shared-memory pool of a tiny geometry (1 layer, 16-byte rows, 16-token chunks
of one page: a chunk is 512 bytes, so the copies cost next to nothing and what is left is
the daemon's per-key work on its event loop), and times, from the client's send to the
reply, median of ``--repeat`` requests of N keys:

- ``store``: N new keys (reserve, gather, commit);
- ``store dedup``: the same N keys again (all cached);
- ``lookup``: the N keys, all hits (the whole prefix is walked);
- ``load``: the N keys into other pages (pin, scatter, unpin).

``heartbeat`` (no keys) is the fixed round trip. It picks ``max_keys_per_request``:
the loop serves nobody else while one request's per-key Python runs. Usage:
``.venv/bin/python tools/keys_cost.py [--sizes 256,1024,4096,16384,65536]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from kvd.bench.common import start_daemon, stop_daemon
from kvd_client import KvdClient, SharedKVPool
from kvd_protocol import wire

CHUNK = 16


def _timed(client, op: str, fields: dict, frames=()) -> float:
    t0 = time.perf_counter()
    client.channel.request(op, fields, frames)
    return (time.perf_counter() - t0) * 1e3


def measure(client, reg, n: int, repeat: int) -> dict:
    out = {"heartbeat": [], "store": [], "store dedup": [], "lookup": [], "load": []}
    src = wire.pages_frame(np.arange(n))
    dst = wire.pages_frame(np.arange(n, 2 * n))
    for _ in range(repeat):
        keys = wire.keys_frame([os.urandom(16) for _ in range(n)])
        out["heartbeat"].append(_timed(client, "heartbeat", {}))
        out["store"].append(_timed(client, "store", {"reg": reg.id}, [keys, src]))
        out["store dedup"].append(_timed(client, "store", {"reg": reg.id}, [keys, src]))
        out["lookup"].append(_timed(client, "lookup", {"reg": reg.id}, [keys]))
        out["load"].append(_timed(client, "load", {"reg": reg.id}, [keys, dst]))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,1024,2048,4096,8192,16384,65536")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    top = max(sizes)
    shard = 2 * CHUNK * 16
    with tempfile.TemporaryDirectory(prefix="kvd-keys-") as rundir:
        daemon = start_daemon(rundir, capacity=(args.repeat + 2) * top * shard + 2**22,
                              chunk_tokens=CHUNK, extra=["--max-keys-per-request", str(top)])
        pool = None
        try:
            client = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True,
                               heartbeat=False).connect()
            pool = SharedKVPool("vllm_flash_attn", 1, 2 * top, CHUNK, 1, 8, "float16")
            reg = client.register_kv(pool, model="keys-cost")
            print(f"per request, ms (median of {args.repeat}); chunk = {shard} bytes")
            print(f"{'keys':>7}" + "".join(f"{k:>13}" for k in
                                            ("heartbeat", "store", "store dedup", "lookup", "load")))
            for n in sizes:
                r = measure(client, reg, n, args.repeat)
                print(f"{n:>7}" + "".join(f"{v:>13.2f}" for v in r.values()), flush=True)
            client.close()
        finally:
            if pool is not None:
                pool.close()
            stop_daemon(daemon, rundir, 30)


if __name__ == "__main__":
    main()
