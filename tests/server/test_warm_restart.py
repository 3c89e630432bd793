"""Warm restart: the host tier survives a daemon's crash, stop or upgrade (real daemons).

A daemon keeps its arena and the arena's index in /dev/shm when it exits;
the next daemon of the same runtime dir adopts them. After SIGKILL at any
moment -- mid-store, between stores, while the previous adoption was still
verifying -- every chunk whose store was acknowledged is a hit with the
exact bytes, and whatever else is served has the exact bytes too (a store
in flight at the kill is never served half-written). A byte flipped in the
arena while the daemon is down fails its checksum: that chunk is dropped
and counted, the rest is served. After SIGTERM the index is trusted (no
verification) and the LRU order is exactly the one at the stop. ``--cold``
starts empty; an arena of another chunk size, capacity or a damaged index
is deleted with a log line; ``warm_restart = false`` keeps nothing.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from pathlib import Path

import numpy as np
import pytest
import workers_warm as W
from daemons import wait_for
from shm_files import arena_files

import kvd_client
from kvd.cli.format import format_stats
from kvd.tiers.host.arena_index import HEADER, LIVE, RECORD_DTYPE

FULL = W.CHUNKS * W.CHUNK  # tokens of one prompt
KNOBS = {"chunk_tokens": W.CHUNK, "host_capacity": "64MiB"}


def host(d) -> dict:
    return d.stats()["tiers"]["host"]


def verified(d) -> dict:
    """The host tier's warm restart stats once no chunk waits for its verification."""
    return wait_for(lambda: (lambda w: w if w["verify"] in ("none", "done") else None)(
        host(d)["warm"]), 30, "the verification to finish")


def sealed(d, shards: int) -> None:
    """Wait until the checksums of ``shards`` stored shards are written."""
    wait_for(lambda: host(d)["warm"]["sealed_shards"] >= shards and
             host(d)["warm"]["unsealed_shards"] == 0, 10, "the checksums")


class Checker:
    """An engine that knows every prompt's bytes (workers_warm) and checks what it loads."""

    def __init__(self, runtime_dir: Path):
        self.client = kvd_client.KvdClient(runtime_dir=str(runtime_dir), timeout=5.0,
                                           raise_errors=True).connect()
        self.pool = W.make_pool()
        self.client.register_kv(self.pool, model=W.MODEL)

    def __enter__(self) -> "Checker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def store(self, i: int) -> int:
        return self.client.store(W.tokens_of(i), W.pages_of(i))

    def hits(self, i: int) -> int:
        return self.client.lookup(W.tokens_of(i))

    def served_exactly(self, i: int) -> int:
        """Chunks of prompt ``i`` the daemon serves, after checking each loaded byte."""
        n = self.hits(i) // W.CHUNK
        if n:
            dst = np.arange(W.PAGES // 2, W.PAGES // 2 + n)
            assert self.client.load(W.tokens_of(i)[:n * W.CHUNK], dst) == n * W.CHUNK
            src = W.pages_of(i)[:n]
            for t in self.pool.tensors:
                raw = t.view(np.uint8)
                assert (raw[:, dst] == raw[:, src]).all(), f"prompt {i}: wrong bytes served"
        return n

    def close(self) -> None:
        self.client.close()
        self.pool.close()


def run_writer(rd: Path, first: int, most: int, kill_at, d,
               pause: float = 0.0) -> tuple[set, set, bool]:
    """Run a writer process (``pause`` seconds between its stores); ``kill_at(events)``
    says when to SIGKILL the daemon. Returns
    (prompts acknowledged, prompts whose store was in flight, whether the kill came while
    a store was in flight)."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=W.writer, args=(str(rd), first, most, send, pause), daemon=True)
    proc.start()
    send.close()
    events, killed = [], False
    try:
        while True:
            assert recv.poll(30), "the writer stopped talking"
            events.append(recv.recv())
            if not killed and kill_at(events):
                d.kill()
                killed = True
                in_flight_at_kill = events[-1][0] == "start"
            if events[-1] == ("exit",):
                break
    finally:
        proc.join(30)
    if not killed:
        d.kill()
        in_flight_at_kill = False
    done = {e[1]: e[2] for e in events if e[0] == "done"}
    started = {e[1] for e in events if e[0] == "start"}
    acked = {i for i, n in done.items() if n == FULL}
    return acked, started - acked, in_flight_at_kill


def test_sigkill_at_any_moment_loses_no_acknowledged_chunk(start_daemon):
    """With ``warm_record_delay_s = 0`` (records at every store; the default's delay is
    tested below)."""
    rng = random.Random(13)
    # room for every prompt: nothing is evicted
    knobs = {**KNOBS, "host_capacity": "384MiB", "warm_record_delay_s": 0}
    d = start_daemon(**knobs)
    rd = d.runtime_dir
    acked, unacked, first, mid_store = set(), set(), 0, 0
    plans = [(40, after_nth_start(rng.randint(3, 12), rng)),  # a store in flight
             (40, after_nth_start(rng.randint(3, 12), rng)),
             (40, after_seconds(rng.uniform(0.05, 0.4))),    # any moment
             (5, lambda events: False)]                       # between stores: all 5 done
    for most, kill_at in plans:
        a, u, in_flight = run_writer(rd, first, most, kill_at, d)
        acked |= a
        unacked = (unacked | u) - acked
        mid_store += in_flight
        first += most
        d = start_daemon(runtime_dir=rd, **knobs)
        assert "after a crash of pid" in d.log(), d.log()
    d.kill()  # once more, while the last adoption may still be verifying
    d = start_daemon(runtime_dir=rd, **knobs)
    warm = verified(d)
    assert warm["start"] == "crash" and warm["checksum_failures"] == 0, warm
    assert warm["bad_records"] == 0, warm
    assert len(acked) >= 10 and mid_store >= 1, (len(acked), mid_store)
    with Checker(rd) as checker:
        for i in sorted(acked):
            assert checker.served_exactly(i) == W.CHUNKS, f"acknowledged prompt {i} was lost"
        for i in sorted(unacked):  # stores the kill interrupted: absent or exact, never torn
            checker.served_exactly(i)


def after_nth_start(k: int, rng: random.Random):
    """Kill right after the ``k``-th store started (plus up to 1 ms): a store in flight."""
    def kill_at(events: list) -> bool:
        if events[-1][0] == "start" and sum(e[0] == "start" for e in events) >= k:
            time.sleep(rng.uniform(0, 0.001))
            return True
        return False
    return kill_at


def after_seconds(seconds: float):
    """Kill at the first event ``seconds`` after the writer was ready."""
    since = []

    def kill_at(events: list) -> bool:
        if events[-1] == ("ready",):
            since.append(time.monotonic())
        return bool(since) and time.monotonic() - since[0] > seconds
    return kill_at


@pytest.mark.parametrize("delay", [0, 0.05])
def test_sigkill_under_eviction_never_serves_wrong_bytes(start_daemon, delay):
    """A tier that holds a quarter of what is stored: slots are reused all the time, so a
    record left on a reused slot, or written before its bytes landed, would serve another
    prompt's bytes after the crash. With a record delay the writer pauses twice the delay
    between stores, so that prompts are recorded a store or two later, while older ones
    are evicted and their records freed (a burst too short for the delay adopts nothing:
    tests/tiers/test_journal_delay.py has the records skipped)."""
    rng = random.Random(7)
    knobs = {**KNOBS, "host_capacity": f"{10 * W.CHUNKS * W.CHUNK_BYTES}",  # 10 prompts
             "warm_record_delay_s": delay}
    d = start_daemon(**knobs)
    rd, first = d.runtime_dir, 0
    for _ in range(3):
        run_writer(rd, first, 40, after_nth_start(rng.randint(15, 35), rng), d, 2 * delay)
        first += 40
        d = start_daemon(runtime_dir=rd, **knobs)
    warm = verified(d)
    assert warm["start"] == "crash" and warm["checksum_failures"] == 0, warm
    assert warm["adopted_chunks"] >= 5 * W.CHUNKS, warm
    with Checker(rd) as checker:
        served = sum(checker.served_exactly(i) for i in range(first))
        assert served >= 5 * W.CHUNKS  # what survived is served, exactly


def test_sigkill_with_records_waiting_loses_only_the_stores_of_the_delay(start_daemon):
    """The worst moment for the record delay: killed while the last stores' records wait.
    What was recorded before is served exactly; what waited is not adopted (a miss), and
    nothing else is served."""
    knobs = {**KNOBS, "warm_record_delay_s": 2}
    d = start_daemon(**knobs)
    rd = d.runtime_dir
    with Checker(rd) as checker:
        for i in range(3):
            assert checker.store(i) == FULL
        sealed(d, 3 * W.CHUNKS)  # the delay passed: recorded and summed
        for i in range(3, 5):
            assert checker.store(i) == FULL
        warm = host(d)["warm"]
        assert warm["records_pending"] == 2 * W.CHUNKS, warm
        d.kill()
    d = start_daemon(runtime_dir=rd, **knobs)
    warm = verified(d)
    assert warm["adopted_chunks"] == 3 * W.CHUNKS and warm["checksum_failures"] == 0, warm
    with Checker(rd) as checker:
        assert [checker.served_exactly(i) for i in range(5)] == [W.CHUNKS] * 3 + [0, 0]


def record_offset(rd: Path, key: bytes) -> int:
    """The arena offset of ``key``'s (only) shard, read from the index file (its format:
    kvd/tiers/host/arena_index.py)."""
    (index,) = [p for p in arena_files(rd) if p.suffix == ".index"]
    table = np.frombuffer(index.read_bytes()[HEADER:], RECORD_DTYPE)
    live = table[(table["state"] == LIVE) & (table["key"] == np.void(key))]
    assert len(live) == 1
    return int(live["offset"][0])


def flip_byte(rd: Path, offset: int) -> None:
    (arena,) = [p for p in arena_files(rd) if p.suffix != ".index"]
    with open(arena, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_a_corrupted_chunk_is_dropped_and_counted_after_a_crash(start_daemon):
    d = start_daemon(**KNOBS)
    rd = d.runtime_dir
    with Checker(rd) as checker:
        for i in range(4):
            assert checker.store(i) == FULL
        bad_key = checker.client.keys(W.tokens_of(1))[5]
    sealed(d, 4 * W.CHUNKS)
    d.kill()
    flip_byte(rd, record_offset(rd, bad_key) + W.CHUNK_BYTES // 3)
    d = start_daemon(runtime_dir=rd, **KNOBS)
    warm = verified(d)
    assert warm["checksum_failures"] == 1 and warm["verified_shards"] == 4 * W.CHUNKS - 1, warm
    assert f"chunk {bad_key.hex()} (shard 0 at offset" in d.log(), d.log()
    assert "failed its checksum after the crash: dropped" in d.log()
    assert ("host: adopted 64 chunks after a crash  verification done (63 shards good, 0 pending, "
            "1 checksum failures)") in format_stats(d.stats())
    with Checker(rd) as checker:
        assert [checker.served_exactly(i) for i in range(4)] == [W.CHUNKS, 5, W.CHUNKS, W.CHUNKS]
        assert host(d)["chunks"] == 4 * W.CHUNKS - 1


def test_sigterm_trusts_the_index_and_keeps_the_lru_order(start_daemon):
    """After a clean stop nothing is verified and every chunk is a hit at once; the LRU
    order is the one at the stop (a crash would fall back to the order of the stores)."""
    knobs = {**KNOBS, "host_capacity": f"{4 * W.CHUNKS * W.CHUNK_BYTES}",  # 4 prompts exactly
             "warm_record_delay_s": 30}  # still waiting at the stop, which records them
    d = start_daemon(**knobs)
    rd = d.runtime_dir
    with Checker(rd) as checker:
        for i in range(4):
            assert checker.store(i) == FULL
        assert checker.hits(0) == FULL  # prompt 0 is now the most recently used
    assert host(d)["warm"]["records_pending"] == 4 * W.CHUNKS
    assert d.stop() == 0
    assert "host tier kept at" in d.log()
    d = start_daemon(runtime_dir=rd, **knobs)
    assert "host tier adopted: 64 chunks (8MiB) after a clean stop: every chunk trusted" in d.log()
    with Checker(rd) as checker:
        warm = host(d)["warm"]
        assert warm["start"] == "clean" and warm["verify"] == "none", warm
        assert warm["verified_shards"] == 0 and warm["verify_pending"] == 0, warm
        assert host(d)["chunks"] == 4 * W.CHUNKS  # all ready at once: nothing to verify
        assert checker.store(4) == FULL  # evicts the least recently used prompt: 1
        assert [checker.served_exactly(i) for i in range(5)] == [W.CHUNKS, 0, W.CHUNKS,
                                                                 W.CHUNKS, W.CHUNKS]


def test_cold_starts_empty(start_daemon):
    d = start_daemon(**KNOBS)
    rd = d.runtime_dir
    with Checker(rd) as checker:
        assert checker.store(0) == FULL
    assert d.stop() == 0
    d = start_daemon(runtime_dir=rd, cold=None, **KNOBS)
    assert (f"cold_start (--cold): deleted the host tier a previous daemon left at "
            f"{arena_files(rd)[0]}; starting empty" in d.log()), d.log()
    assert host(d)["warm"]["start"] == "new" and host(d)["chunks"] == 0
    with Checker(rd) as checker:
        assert checker.hits(0) == 0
    assert len(arena_files(rd)) == 2  # a new host tier, kept in its turn


@pytest.mark.parametrize("change", ["chunk_tokens", "host_capacity", "damaged index",
                                    "no index", "disk_dir"])
def test_an_arena_it_cannot_adopt_is_deleted_with_a_log_line(start_daemon, tmp_path, change):
    d = start_daemon(**KNOBS)
    rd = d.runtime_dir
    with Checker(rd) as checker:
        assert checker.store(0) == FULL
    assert d.stop() == 0
    knobs, index = dict(KNOBS), arena_files(rd)[1]
    why = {"chunk_tokens": "made for chunk_tokens 16, this daemon has 32",
           "host_capacity": "made for host_capacity 67108864 bytes (file of 67108864), this "
                            "daemon has 33554432",
           "damaged index": f"{index.name} is not a kvd host tier index",
           "no index": f"cannot open {index.name}: No such file or directory",
           "disk_dir": "made with slot alignment 256, this daemon uses 4096: disk_dir was set or "
                       "unset"}[change]
    if change == "chunk_tokens":
        knobs["chunk_tokens"] = 32
    elif change == "host_capacity":
        knobs["host_capacity"] = "32MiB"
    elif change == "damaged index":
        index.write_bytes(b"garbage!" + index.read_bytes()[8:])
    elif change == "no index":
        index.unlink()
    else:
        knobs["disk_dir"] = str(tmp_path / "disk")
    d = start_daemon(runtime_dir=rd, **knobs)
    assert f"host tier at {arena_files(rd)[0]} not adopted ({why}): deleted it; starting empty" \
        in d.log(), d.log()
    assert host(d)["warm"]["start"] == "new" and host(d)["chunks"] == 0
    assert len(arena_files(rd)) == 2


def test_warm_restart_off_keeps_nothing(start_daemon):
    d = start_daemon(**KNOBS)
    rd = d.runtime_dir
    assert d.stop() == 0
    assert len(arena_files(rd)) == 2
    d = start_daemon(runtime_dir=rd, warm_restart="false", **KNOBS)
    assert "warm_restart is off: deleted the host tier a previous daemon left at" in d.log()
    assert "warm" not in host(d)
    assert d.stop() == 0
    assert arena_files(rd) == []


def test_on_disk_marks_survive_and_are_checked_against_the_disk_tier(start_daemon, tmp_path):
    disk = tmp_path / "disk"
    knobs = {**KNOBS, "disk_dir": str(disk), "disk_capacity": "64MiB"}
    d = start_daemon(**knobs)
    rd = d.runtime_dir
    with Checker(rd) as checker:
        for i in range(2):
            assert checker.store(i) == FULL
    assert d.control("flush_disk")["written"] == 2 * W.CHUNKS
    assert host(d)["on_disk"] == 2 * W.CHUNKS
    assert d.stop() == 0
    d = start_daemon(runtime_dir=rd, **knobs)
    assert host(d)["on_disk"] == 2 * W.CHUNKS and host(d)["chunks"] == 2 * W.CHUNKS
    assert d.stop() == 0
    files = [p for p in disk.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert len(files) == 2 * W.CHUNKS
    for p in files:  # the disk copies go while no daemon runs
        p.unlink()
    d = start_daemon(runtime_dir=rd, **knobs)
    wait_for(lambda: d.stats()["tiers"]["disk"]["recovery"]["state"] == "done", 10, "recovery")
    wait_for(lambda: host(d)["on_disk"] == 0, 10, "the on-disk marks to be cleared")
    assert "host chunks marked on disk are not there: unmarked" in d.log()
    assert host(d)["chunks"] == 2 * W.CHUNKS


def test_a_bug_in_adopting_starts_empty_instead_of_failing_for_good(start_daemon):
    """Never a crash loop over a file the daemon cannot read: a rebuild that raises (a bug
    of ours, injected) is logged with its traceback, and the daemon starts empty."""
    d = start_daemon(**KNOBS)
    rd = d.runtime_dir
    with Checker(rd) as checker:
        assert checker.store(0) == FULL
    assert d.stop() == 0
    d = start_daemon(runtime_dir=rd, faults="rebuild_bug", **KNOBS)
    assert "could not be adopted (a bug in kvd, please report it); deleting it and starting " \
        "empty" in d.log(), d.log()
    assert "ValueError: a bug, injected" in d.log()
    assert host(d)["warm"]["start"] == "new" and host(d)["chunks"] == 0
    with Checker(rd) as checker:
        assert checker.hits(0) == 0 and checker.store(0) == FULL and checker.hits(0) == FULL
    assert d.stop() == 0 and len(arena_files(rd)) == 2
