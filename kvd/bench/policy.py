"""``kvd bench --disk-policy``: what ``disk_min_hits`` (the "second hit" rule) does.

A private host-backend daemon per ``disk_min_hits`` setting (0, 1, 2) runs the same seeded
workload: requests that are recurring hot prompts (more than the host tier holds) or
one-off prompts, each looked up, loaded and stored as an engine does. Reports per setting:
share of chunks served from cache, bytes written to disk, cold chunks not demoted, wall
time. A benchmark, not a test.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

CHUNK, CHUNKS, HOT, HOST_CHUNKS = 64, 4, 48, 96
SPEC = ("vllm_flash_attn", 4, 2, 64, "float16")  # layout, layers, kv heads, head dim, dtype
SHARD = 4 * 2 * CHUNK * 2 * 64 * 2


def add_arguments(p) -> None:
    p.add_argument("--disk-policy", action="store_true", help="measure disk_min_hits 0/1/2 on a "
                   "workload of recurring and one-off prompts (uses --disk-dir)")
    p.add_argument("--policy-requests", type=int, default=1500, help="with --disk-policy: requests")
    p.add_argument("--policy-hot", type=float, default=0.5,
                   help="with --disk-policy: share of requests that reuse a recurring prompt")


def run(args) -> int:
    from kvd.bench.common import control, start_daemon, stop_daemon
    from kvd_client import KvdClient, SharedKVPool
    
    base = Path(tempfile.mkdtemp(prefix="kvd-bench-policy-", dir=args.disk_dir))
    rng = np.random.default_rng(0)
    picks = [int(rng.integers(HOT)) if rng.random() < args.policy_hot else HOT + i
             for i in range(args.policy_requests)]  # prompt ids; >= HOT: seen once
    print(f"kvd bench --disk-policy: {args.policy_requests} requests of {CHUNKS} chunks "
          f"({SHARD >> 10} KiB each), {args.policy_hot:.0%} from {HOT} recurring prompts "
          f"({HOT * CHUNKS} chunks), host tier {HOST_CHUNKS} chunks, disk in {base.parent}",
          flush=True)
    print(f"{'min_hits':>8}{'served':>9}{'disk GB written':>17}{'cold skipped':>14}"
          f"{'lost':>6}{'seconds':>9}")
    try:
        for min_hits in (0, 1, 2):
            rundir = tempfile.mkdtemp(prefix="kvd-policy-run-")
            knobs = ["--disk-dir", str(base / f"disk{min_hits}"), "--disk-min-hits", str(min_hits),
                     "--disk-capacity", "2GiB", "--gpu", "off"]  # writes < 1 GB; 64 GiB may not fit
            daemon = start_daemon(rundir, capacity=HOST_CHUNKS * SHARD, chunk_tokens=CHUNK,
                                   extra=knobs)
            pool = None
            try:
                client = KvdClient(runtime_dir=rundir, timeout=60, raise_errors=True,
                                   heartbeat=False).connect()
                pool = SharedKVPool(SPEC[0], SPEC[1], 2 * CHUNKS * CHUNK // 16, 16, *SPEC[2:])
                client.register_kv(pool, model="kvd-bench-policy")
                t0 = time.perf_counter()
                served = sum(_request(client, pick) for pick in picks)
                secs = time.perf_counter() - t0
                client.close()
                st = control(rundir, "stats")["tiers"]
            finally:
                if pool is not None:
                    pool.close()
                stop_daemon(daemon, rundir, 60)
                shutil.rmtree(rundir, ignore_errors=True)
            disk = st["disk"]
            print(f"{min_hits:>8}{served / (len(picks) * CHUNKS):>9.1%}"
                  f"{disk['write_bytes'] / 1e9:>17.3f}{disk['demotions_skipped_cold']:>14}"
                  f"{st['host']['evicted_not_on_disk']:>6}{secs:>9.1f}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _request(client, pick: int) -> int:
    """One engine request: lookup, load the cached prefix, store the rest; chunks served."""
    tokens = np.arange(CHUNKS * CHUNK) + pick * 1000
    pages = list(range(CHUNKS * CHUNK // 16))
    hit = client.lookup(tokens)
    loaded = client.load(tokens[:hit], pages[:hit // 16]) if hit else 0
    if loaded < len(tokens):
        client.store(tokens, pages)
    return loaded // CHUNK
