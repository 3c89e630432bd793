"""What a remote store's round trip adds to a lookup that misses: two daemons, alternating.

``--lookups N`` times N lookups of chunks no tier holds (an attached
registration, what a scheduler does) against two ``kvd serve`` daemons, one
with the remote tier on a loopback ``redis-server``/``valkey-server`` and one
without, alternating in rounds of ``--repeat``. Nothing is timed against a
fixed number: the two are printed side by side. The remote tier's put/get
throughput against the store's own client (and a half-local, half-remote
load) is ``kvd bench --remote`` (kvd/bench/remote.py).

Usage: ``python tools/remote_bench.py --lookups 300 [--repeat 4]``
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np

from kvd.bench.stores import RedisServer

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
    p.add_argument("--lookups", type=int, default=300)
    p.add_argument("--repeat", type=int, default=4)
    args = p.parse_args()
    why = RedisServer.missing()
    if why:
        raise SystemExit(why)
    server = RedisServer().start()
    tmp = tempfile.mkdtemp(prefix="kvd-remote-bench-")
    try:
        lookups(server.url, tmp, args.lookups, args.repeat)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
