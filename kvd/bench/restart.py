"""``kvd bench --restart``: how soon a restarted daemon serves hits again, cold vs warm.

Per way to restart (``cold``: SIGTERM then ``--cold``; ``warm, SIGTERM``; ``warm,
SIGKILL``: a crash once every chunk is recorded and checksummed, chunks
verified in the background), on a private daemon whose host tier
was filled first. Measured from the new process's start: when it serves, when a lookup of
the last prompt first hits, the share of chunks that hit at once, and when verification
ended. Nothing is left in /dev/shm.
"""

from __future__ import annotations

import signal
import tempfile
import time

import numpy as np

from kvd_protocol.keys import DTYPE_SIZES

from .common import control, start_daemon, stop_daemon

POLL_S = 0.005
MODES = ("cold", "warm, SIGTERM", "warm, SIGKILL")


def add_arguments(p) -> None:
    p.add_argument("--restart", action="store_true", help="time from a restart to the first hit "
                   "and hit rate after it, cold vs warm (SIGTERM, SIGKILL), for a host tier of "
                   "--restart-gib")
    p.add_argument("--restart-gib", type=float, default=4.0, help="with --restart: host tier "
                   "size in GiB (filled before each restart)")


def run(args) -> int:
    from kvd_client import KvdClient, SharedKVPool

    row = args.kv_heads * args.head_dim * DTYPE_SIZES[args.dtype]
    planes = 1 if args.layout.endswith("mla") else 2
    shard = args.layers * planes * args.chunk_tokens * row
    capacity = int(args.restart_gib * 2**30) // 4096 * 4096
    requests = max(1, capacity // (shard * args.chunks))
    ppc = args.chunk_tokens // args.page_size
    print(f"kvd bench --restart: a {args.restart_gib:g} GiB host tier filled with {requests} "
          f"prompts of {args.chunks} chunks of {shard / 2**20:.2f} MiB ({args.layout}, "
          f"{args.layers} layers); per mode: fill, stop, start, measure", flush=True)
    rows = []
    for mode in MODES:
        with tempfile.TemporaryDirectory(prefix="kvd-bench-restart-") as rundir:
            daemon = start_daemon(rundir, capacity, args.chunk_tokens)
            pool = SharedKVPool(args.layout, args.layers, args.chunks * ppc, args.page_size,
                                args.kv_heads, args.head_dim, args.dtype)
            try:
                pool.raw[:] = np.random.default_rng(0).integers(0, 256, pool.raw.size, np.uint8)
                prompts = _fill(KvdClient, pool, rundir, args, requests, ppc)
                if mode.endswith("SIGKILL"):
                    print(f"  {mode}: kill {_wait_recorded(rundir):.2f} s after the last store, "
                          "every chunk recorded and checksummed", flush=True)
                daemon.send_signal(signal.SIGKILL if mode.endswith("SIGKILL") else signal.SIGTERM)
                daemon.wait(120)
                t0 = time.monotonic()
                daemon = start_daemon(rundir, capacity, args.chunk_tokens,
                                      extra=("--cold",) if mode == "cold" else ())
                rows.append((mode, *_after_restart(KvdClient, pool, rundir, prompts, t0)))
                print(f"  {mode}: done", flush=True)
            finally:
                pool.close()
                stop_daemon(daemon, rundir, 120)
    _report(rows, requests * args.chunks)
    return 0


def _tokens(args, i: int) -> np.ndarray:
    return np.arange(args.chunks * args.chunk_tokens) + i * 10**7


def _fill(KvdClient, pool, rundir: str, args, requests: int, ppc: int) -> list:
    client = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True, heartbeat=False).connect()
    try:
        client.register_kv(pool, model="kvd-bench-restart")
        prompts = [_tokens(args, i) for i in range(requests)]
        pages = np.arange(args.chunks * ppc)
        for tokens in prompts:
            if client.store(tokens, pages) != len(tokens):
                raise RuntimeError("a store of the fill failed")
    finally:
        client.close()
    return prompts


def _wait_recorded(rundir: str, timeout: float = 120.0) -> float:
    """Seconds until the daemon has no record waiting (warm_record_delay_s) and no record
    without its checksum; RuntimeError past ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        warm = control(rundir, "stats")["tiers"]["host"].get("warm", {})
        if warm.get("records_pending", 0) == 0 and warm.get("unsealed_shards", 0) == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise RuntimeError(f"the daemon still had records waiting after {timeout:g} s")


def _after_restart(KvdClient, pool, rundir: str, prompts: list, t0: float):
    """(s to serving, s to first hit, hit share at serving, hit share when verified,
    verification s, how the host tier started: new, clean or crash)."""
    while True:
        try:
            control(rundir, "health", timeout=0.5)
            break
        except Exception:  # noqa: BLE001 - not serving yet
            time.sleep(POLL_S)
    serving = time.monotonic() - t0
    client = KvdClient(runtime_dir=rundir, timeout=120, raise_errors=True, heartbeat=False).connect()
    try:
        client.register_kv(pool, model="kvd-bench-restart")
        total = sum(len(p) for p in prompts)
        first_hit, deadline = None, time.monotonic() + 5.0
        while first_hit is None and time.monotonic() < deadline:
            if client.lookup(prompts[-1]):
                first_hit = time.monotonic() - t0
            else:
                time.sleep(POLL_S)
        at_serving = sum(client.lookup(p) for p in prompts) / total
        warm = {}
        while True:
            warm = control(rundir, "stats")["tiers"]["host"].get("warm", {})
            if warm.get("verify", "none") in ("none", "done"):
                break
            time.sleep(0.05)
        verified = sum(client.lookup(p) for p in prompts) / total
    finally:
        client.close()
    return (serving, first_hit, at_serving, verified, warm.get("verify_seconds", 0.0),
            warm.get("start", "new"))


def _report(rows: list, chunks: int) -> None:
    print(f"\n{chunks} chunks stored before each restart; seconds from the new process's start")
    print(f"{'restart':<16}{'serving s':>10}{'first hit s':>13}{'hits at serving':>17}"
          f"{'hits verified':>15}{'verify s':>10}{'host tier':>11}")
    for mode, serving, first, at_serving, verified, secs, start in rows:
        first_text = "never" if first is None else f"{first:.2f}"
        print(f"{mode:<16}{serving:>10.2f}{first_text:>13}{at_serving:>17.0%}{verified:>15.0%}"
              f"{secs:>10.2f}{start:>11}")
