"""The remote tier against the store's own client, same server, same run: what kvd's path costs.

Starts a ``redis-server``/``valkey-server`` on a free loopback port (no
persistence), fills a host tier (kvd.tiers.host over a numpy arena) with
``--chunks`` chunks of ``--chunk-mib`` MiB, then alternates, ``--repeat``
times: the tier's publication (pack with header and digest on a CPU
thread, exists + SET on ``--threads`` threads) against plain SETs of the
same bytes on as many threads; then the tier's promotion of every chunk
into fresh host slots (GET, header check, digest verified while copying
in; with ``--secret``, the keyed tag of remote_secret too) against plain
GETs into memory. Prints GB/s of each and tier/raw.
``--lookups N`` instead times N lookups of chunks no tier holds (an
attached registration, what a scheduler does) against two ``kvd serve``
daemons, one with the remote tier on this server and one without,
alternating in rounds: what the store's round trip adds to a miss.
Nothing is timed against a fixed number: the ratio is what it reports.

Usage: ``python tools/remote_bench.py [--chunks 64] [--chunk-mib 4] [--threads 4] [--repeat 3]
[--lookups N] [--secret S]``
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvd.tiers.host import HostTier
from kvd.tiers.remote import RemoteTier
from kvd.tiers.remote_store import RedisStore
from kvd.tiers.remote_tiering import RemoteTiering
from kvd.tiers.remote_value import Seal
from kvd.tiers.scope import Scope

NS = bytes(range(16))


def start_redis(tmp: str):
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("needs valkey-server or redis-server (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise SystemExit("redis did not start")


def fill_host(host: HostTier, view: np.ndarray, n: int, size: int, round_: int) -> list:
    keys = [round_.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(n)]
    todo, _ = host.reserve_many(keys, NS, size, 1, 0)
    rng = np.random.default_rng(round_)
    for _, e in todo:
        view[e.offset:e.offset + size] = rng.integers(0, 256, size, dtype=np.uint8)
        host.commit(e, 0)
    return [e for _, e in todo]


async def tier_round(url: str, view, host: HostTier, entries: list, threads: int,
                     seal: Seal | None) -> tuple:
    remote = RemoteTier(RedisStore(url, 5.0), "bench", 5.0, 2 * threads + 2, 3, 1.0)
    tiering = RemoteTiering(host, remote, view, "store", len(entries), seal)
    # as many puts and fetches at once as the raw side has threads (the daemon gives a
    # quarter of remote_threads to puts and half to fetches)
    tiering.parallel(threads, threads)
    tiering.start()
    while not remote.breaker.allow():
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    tiering.stored(entries)
    await asyncio.gather(*list(tiering.publishing.values()))
    put_s = time.perf_counter() - t0
    keys = [e.key for e in entries]
    host.clear()
    t0 = time.perf_counter()
    got = await tiering.promote_prefix(Scope(NS, 1, entries[0].shard_bytes), keys)
    get_s = time.perf_counter() - t0
    assert len(got) == len(keys), (len(got), tiering.stats())
    host.unpin(got)
    host.clear()
    await tiering.stop()
    return put_s, get_s


def raw_round(url: str, values: list, threads: int, round_: int) -> tuple:
    import redis
    client = redis.Redis.from_url(url, max_connections=threads + 1)
    names = [f"raw/{round_}/{i}" for i in range(len(values))]
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda nv: client.set(*nv), zip(names, values)))
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = list(pool.map(client.get, names))
        get_s = time.perf_counter() - t0
    assert all(len(g) == len(v) for g, v in zip(got, values))
    client.delete(*names)
    client.close()
    return put_s, get_s


def lookup_round(rundir: str, n: int, seed: int) -> list:
    import kvd_client
    client = kvd_client.KvdClient(runtime_dir=rundir, timeout=20, raise_errors=True).connect()
    client.attach("bench/lookups", "bfloat16", "mha", 32, 8, 128)
    tokens = np.random.default_rng(seed).integers(0, 2**31, (n, 2 * 256))
    out = []
    for row in tokens:
        t0 = time.perf_counter()
        assert client.lookup(row) == 0
        out.append(time.perf_counter() - t0)
    client.close()
    return out


def lookups(url: str, tmp: str, n: int, repeat: int) -> None:
    from kvd.bench.common import start_daemon
    dirs = {"off": (f"{tmp}/off", []),
            "remote": (f"{tmp}/remote", ["--remote-backend", "redis", "--remote-address", url])}
    procs = [start_daemon(rd, 64 << 20, 256, extra) for rd, extra in dirs.values()]
    try:
        from kvd.bench.common import control
        while control(dirs["remote"][0], "stats")["tiers"]["remote"]["breaker"] != "closed":
            time.sleep(0.05)
        secs = {name: [] for name in dirs}
        for r in range(repeat):
            for name in (("off", "remote") if r % 2 == 0 else ("remote", "off")):
                secs[name] += lookup_round(dirs[name][0], n, r)
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    print(f"lookups of 2 chunks that no tier holds, {n} x {repeat} each, alternating")
    print(f"{'daemon':<10}{'p50 ms':>9}{'p99 ms':>9}")
    for name, v in secs.items():
        v.sort()
        print(f"{name:<10}{1e3 * v[len(v) // 2]:>9.3f}{1e3 * v[int(0.99 * len(v))]:>9.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--chunk-mib", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--lookups", type=int, default=0)
    p.add_argument("--secret", default="", help="the tier with this remote_secret (keyed tags)")
    args = p.parse_args()
    seal = Seal(args.secret) if args.secret else None
    size = int(args.chunk_mib * 2**20)
    tmp = tempfile.mkdtemp(prefix="kvd-remote-bench-")
    proc, url = start_redis(tmp)
    if args.lookups:
        try:
            lookups(url, tmp, args.lookups, args.repeat)
        finally:
            proc.kill()
            proc.wait()
            shutil.rmtree(tmp, ignore_errors=True)
        return
    runs = {"tier put": [], "tier get": [], "raw put": [], "raw get": []}
    try:
        view = np.zeros(2 * args.chunks * size, np.uint8)
        host = HostTier(len(view), 4096)
        total = args.chunks * size
        for r in range(args.repeat):
            entries = fill_host(host, view, args.chunks, size, r)
            values = [bytes(view[e.offset:e.offset + size]) for e in entries]
            order = ("tier", "raw") if r % 2 == 0 else ("raw", "tier")  # alternate who goes first
            for side in order:
                if side == "tier":
                    put_s, get_s = asyncio.run(tier_round(url, view, host, entries, args.threads,
                                                          seal))
                else:
                    put_s, get_s = raw_round(url, values, args.threads, r)
                runs[f"{side} put"].append(total / put_s / 1e9)
                runs[f"{side} get"].append(total / get_s / 1e9)
            host.clear()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"remote tier vs redis-py on one loopback redis-server: {args.chunks} chunks of "
          f"{args.chunk_mib:g} MiB, {args.threads} threads, median of {args.repeat}"
          + (", keyed (remote_secret)" if seal else ""))
    print(f"{'direction':<10}{'tier GB/s':>11}{'raw GB/s':>10}{'tier/raw':>10}")
    for d in ("put", "get"):
        print(f"{d:<10}{med['tier ' + d]:>11.3f}{med['raw ' + d]:>10.3f}"
              f"{med['tier ' + d] / med['raw ' + d]:>10.2f}")


if __name__ == "__main__":
    main()
