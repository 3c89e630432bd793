"""``kvd bench --remote``: the remote tier against the store's own client, same objects.

Per store of ``--remote-stores`` (loopback redis/valkey or mooncake_master, started by
kvd.bench.stores; skipped with the reason when missing), rounds rotating who goes first:
kvd's tier publishes and promotes ``--remote-chunks`` chunks (zero-copy and bytes paths)
against the store's own client (redis-py; Mooncake's put/get and zero-copy calls), with and
without kvd's checksum work added. Then the half-local, half-remote load
(kvd.bench.remote_load). Prints median GB/s and ratios; ``--json`` keeps every run.
A benchmark: it asserts nothing about speed.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvd.tiers.disk.digest import payload_digest
from kvd.tiers.host.arena import SharedArena, arena_path
from kvd.tiers.host.tier import HostTier
from kvd.tiers.remote.calls import CPU_THREADS
from kvd.tiers.remote.digest_pool import DigestPool, auto_processes
from kvd.tiers.remote.tier import RemoteTier
from kvd.tiers.remote.tiering import RemoteTiering
from kvd.tiers.remote.value import Seal
from kvd.tiers.scope import Scope

from .stores import MooncakeMaster, RedisServer, mooncake_env

NS = bytes(range(16))
STORES = ("redis", "mooncake")
SIDES = {"redis": ("kvd zero-copy", "kvd bytes", "client", "client+digest"),
         "mooncake": ("kvd zero-copy", "kvd bytes", "client bytes", "client zero-copy",
                      "client zc+digest")}
# what kvd's first side is set against; Mooncake also against its client doing kvd's checksums
MATCH = {"redis": ("client", "client+digest"), "mooncake": ("client zero-copy", "client zc+digest")}


class BenchFailed(Exception):
    """A round moved fewer chunks than it was given: its figures would mean nothing."""


def add_arguments(p) -> None:
    p.add_argument("--remote", action="store_true", help="benchmark the remote tier against the "
                   "store's own client (redis-py, Mooncake) on loopback, and a half-local, "
                   "half-remote load against its halves (see --remote-*)")
    p.add_argument("--remote-stores", default=",".join(STORES), help="with --remote: stores, "
                   "comma-separated (redis, mooncake)")
    p.add_argument("--remote-chunks", type=int, default=32, help="with --remote: chunks per round")
    p.add_argument("--remote-chunk-mib", type=float, default=4.0, help="with --remote: MiB per chunk")
    p.add_argument("--remote-threads", type=int, default=4,
                   help="with --remote: puts and gets at a time, on each side")
    p.add_argument("--remote-digest-processes", type=int, default=-1, help="with --remote: "
                   "kvd's checksum processes on the zero-copy path, as the daemon's "
                   "remote_digest_processes (-1: one per 4 cores, at most 8; 0: none)")
    p.add_argument("--remote-secret", default="", help="with --remote: the tier with this "
                   "remote_secret (values carry a keyed tag, checked on every get)")


def run(args) -> int:
    size = int(args.remote_chunk_mib * 2**20)
    stores = args.remote_stores.split(",")
    unknown = [n for n in stores if n not in STORES]
    if unknown:
        print(f"kvd bench --remote: unknown store {unknown[0]!r} (known: {', '.join(STORES)})")
        return 2
    moves = {}
    processes = auto_processes(args.remote_digest_processes)
    for name in stores:
        why = (RedisServer if name == "redis" else MooncakeMaster).missing()
        if why:
            print(f"{name}: skipped: {why}")
            continue
        seal = Seal(args.remote_secret) if args.remote_secret else None
        moves[name] = _store_runs(name, args.remote_chunks, size, args.remote_threads,
                                  args.repeat, seal, processes)
        _report(name, moves[name], args)
    from .remote_load import run as run_load
    loads = run_load(args)
    if args.json:
        from .common import write_json
        write_json(args.json, remote={"chunks": args.remote_chunks, "chunk_bytes": size,
                                      "threads": args.remote_threads, "repeat": args.repeat,
                                      "keyed": bool(args.remote_secret), "moves_gbps": moves,
                                      "kvd_vs": MATCH},
                   remote_load_s=loads)
    return 0


def _store_runs(name: str, chunks: int, size: int, threads: int, repeat: int, seal,
                digest_processes: int = 0) -> dict:
    server = (RedisServer if name == "redis" else MooncakeMaster)().start()
    # the host arena as the daemon has it (a shared-memory file: checksum processes map it);
    # its last third: the client's own memory
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    arena = SharedArena(arena_path(shm, f"bench-{os.getpid()}"), 3 * chunks * size)
    digests = DigestPool(arena.path, arena.view.nbytes, digest_processes)
    try:
        host = HostTier(2 * chunks * size, 4096)
        return asyncio.run(_rounds(server, name, arena.view, host, chunks, size, threads, repeat,
                                   seal, digests))
    finally:
        digests.close()
        arena.close()
        server.stop()


def _tier_store(server, name: str, nbytes: int, repeat: int):
    if name == "redis":
        from kvd.tiers.remote.store import RedisStore
        return RedisStore(server.url, 5.0)
    import os
    os.environ.update(mooncake_env())
    from kvd.tiers.remote.mooncake import MooncakeStore
    # its segment holds every side's values of every round (a removed value's space may come
    # back only after its lease ends)
    return MooncakeStore(server.address, 5.0, server.metadata, "127.0.0.1",
                         len(SIDES[name]) * (repeat + 1) * nbytes + (64 << 20), 64 << 20)


async def _rounds(server, name, view, host, chunks, size, threads, repeat, seal, digests) -> dict:
    remote = RemoteTier(_tier_store(server, name, chunks * size, repeat), "bench", 5.0, 2 * threads + 2,
                        3, 1.0, max(CPU_THREADS, digests.started))
    sides = SIDES[name]
    runs: dict = {f"{side} {d}": [] for side in sides for d in ("put", "get")}
    tiering = RemoteTiering(host, remote, view, "store", chunks, seal, digests)
    tiering.parallel(threads, threads)  # as many as the client side (the daemon: 1/4, 1/2)
    tiering.start()
    try:
        while not remote.breaker.allow():
            await asyncio.sleep(0.01)
        if not tiering.zero_copy:
            raise BenchFailed(f"the zero-copy path is off: {remote.store.zero_copy_off}")
        for r in range(repeat):
            entries = _fill(host, view, chunks, size, r)
            values = [bytes(view[e.offset:e.offset + size]) for e in entries]
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                if side.startswith("kvd"):  # the entries the last kvd side fetched back
                    entries = [host.entries[e.key] for e in entries]
                    put_s, get_s = await _tier_round(tiering, host, entries, side == "kvd bytes")
                else:
                    raw = _raw_client(server, name, remote, threads, view[2 * chunks * size:],
                                      side.startswith("client z"), side.endswith("digest"))
                    put_s, get_s = await asyncio.to_thread(raw, values, r)
                runs[f"{side} put"].append(chunks * size / put_s / 1e9)
                runs[f"{side} get"].append(chunks * size / get_s / 1e9)
            host.clear()
    finally:
        await tiering.stop()
    return runs


def _fill(host: HostTier, view: np.ndarray, n: int, size: int, round_: int) -> list:
    keys = [round_.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(n)]
    todo, _ = host.reserve_many(keys, NS, size, 1, 0)
    rng = np.random.default_rng(round_)
    for _, e in todo:
        view[e.offset:e.offset + size] = rng.integers(0, 256, size, dtype=np.uint8)
        host.commit(e, 0)
    return [e for _, e in todo]


async def _tier_round(tiering: RemoteTiering, host: HostTier, entries: list,
                      bytes_path: bool) -> tuple:
    """(put s, get s) of kvd's tier; ``bytes_path``: with the zero-copy path switched off."""
    store = tiering.remote.store
    off = getattr(store, "zero_copy_off", None)
    if bytes_path:
        store.zero_copy_off = "kvd bench: the bytes path"
    try:
        return await _tier_moves(tiering, host, entries)
    finally:
        if bytes_path:
            store.zero_copy_off = off


async def _tier_moves(tiering: RemoteTiering, host: HostTier, entries: list) -> tuple:
    t0 = time.perf_counter()
    tiering.stored(entries)
    await asyncio.gather(*list(tiering.publishing.values()))
    put_s = time.perf_counter() - t0
    keys = [e.key for e in entries]
    host.clear()
    t0 = time.perf_counter()
    got = await tiering.promote_prefix(Scope(NS, 1, entries[0].shard_bytes), keys)
    get_s = time.perf_counter() - t0
    host.unpin(got)
    if len(got) != len(keys):
        raise BenchFailed(f"kvd fetched {len(got)} of {len(keys)} chunks: {tiering.stats()}")
    for key in keys:  # gone: the next side puts them again
        await tiering.remote.call(_remover(tiering.remote.store), tiering.remote.name(NS, key))
        tiering.remote.forget(tiering.remote.name(NS, key))
    return put_s, get_s


def _remover(store):
    """Delete at once (Mooncake: ``force``, its lease would keep the value a few seconds)."""
    if store.name == "mooncake":
        return lambda name: store.store.remove(name, True)
    return store.delete


def _raw_client(server, name: str, remote: RemoteTier, threads: int, own: np.ndarray,
                zero_copy: bool, digest: bool = False):
    """round(values, r) -> (put s, get s): the store's own client, ``threads`` at a time;
    ``zero_copy``: Mooncake's put_from/get_into from and into ``own`` (registered memory:
    the arena's tail), one object a call."""
    if name == "redis":
        import redis
        client = redis.Redis.from_url(server.url, max_connections=threads + 1)
        put, get, delete = client.set, client.get, client.delete
        if digest:  # kvd's checksum work, in the client's threads: a verified transfer's cost
            put, get = _checked(put, get)
    else:  # the tier's own MooncakeDistributedStore: one instance per process
        store = remote.store.store
        put, get = store.put, store.get

        def delete(name):
            store.remove(name, True)

    def round_(values: list, r: int) -> tuple:
        names = [f"raw/{r}/{zero_copy:d}{digest:d}/{i}" for i in range(len(values))]
        if zero_copy:
            return _zero_copy_round(remote.store.store, names, values, own, threads, digest)
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(put, names, values))
            put_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = list(pool.map(get, names))
            get_s = time.perf_counter() - t0
        if [len(g) for g in got] != [len(v) for v in values]:
            raise BenchFailed("the store's client got other sizes back")
        for n in names:
            delete(n)
        return put_s, get_s
    return round_


def _checked(put, get):
    """``put``/``get`` of bytes that compute the payload digest before each put and check it
    after each get, as kvd does."""
    sums: dict = {}

    def checked_put(name, value):
        sums[name] = payload_digest(value)
        return put(name, value)

    def checked_get(name):
        value = get(name)
        if value is not None and payload_digest(value) != sums[name]:
            raise BenchFailed("the store's client got other bytes back")
        return value
    return checked_put, checked_get


def _zero_copy_round(store, names: list, values: list, own: np.ndarray, threads: int,
                     digest: bool) -> tuple:
    """Mooncake's zero-copy calls, one object a call; ``digest``: each put computes, and each
    get checks, the payload digest kvd puts in a value's header (the same XXH3 work)."""
    size = len(values[0])
    for i, v in enumerate(values):
        own[i * size:(i + 1) * size] = np.frombuffer(v, np.uint8)
    ptrs = [own.ctypes.data + i * size for i in range(len(values))]

    sums = [payload_digest(own[i * size:(i + 1) * size]) for i in range(len(values))]

    def put(name, ptr):
        if digest:
            payload_digest(own[ptr - own.ctypes.data:ptr - own.ctypes.data + size])
        return store.batch_put_from([name], [ptr], [size])[0]

    def get(name, ptr):
        got = store.batch_get_into([name], [ptr], [size])[0]
        at = ptr - own.ctypes.data
        if digest and payload_digest(own[at:at + size]) != sums[at // size]:
            raise BenchFailed("Mooncake's zero-copy get brought other bytes")
        return got
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        codes = list(pool.map(put, names, ptrs))
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = list(pool.map(get, names, ptrs))
        get_s = time.perf_counter() - t0
    if any(codes) or got != [size] * len(values):
        raise BenchFailed(f"Mooncake's zero-copy calls failed: put {codes}, get {got}")
    for name in names:
        store.remove(name, True)
    return put_s, get_s


def _report(name: str, runs: dict, args) -> None:
    med = {k: statistics.median(v) for k, v in runs.items()}
    sides, match = SIDES[name], MATCH[name]
    print(f"{name}: kvd's remote tier vs the store's own client on loopback, "
          f"{args.remote_chunks} chunks of {args.remote_chunk_mib:g} MiB, {args.remote_threads} "
          f"at a time, median of {args.repeat} GB/s" + (", keyed" if args.remote_secret else "")
          + f", checksums in {auto_processes(args.remote_digest_processes)} processes")
    print(f"{'direction':<10}" + "".join(f"{s:>18}" for s in sides)
          + "".join(f"{'kvd/' + m:>22}" for m in match))
    for d in ("put", "get"):
        print(f"{d:<10}" + "".join(f"{med[f'{s} {d}']:>18.3f}" for s in sides)
              + "".join(f"{med[f'{sides[0]} {d}'] / med[f'{m} {d}']:>22.2f}" for m in match),
              flush=True)
