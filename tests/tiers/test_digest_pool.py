"""Checksum processes (kvd/tiers/remote/digest_pool.py, kvd/tiers/remote/digest_worker.py), real processes
over a real shared-memory file: their digests are kvd/tiers/disk/digest.py's, byte for byte, from
several threads at once; a worker killed, hung or refusing is dropped and the digest is
computed in the caller instead (the same answer); a worker refuses ranges outside its file
and ends at the end of its input; ``close`` leaves no process."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvd.tiers.disk.digest import SEGMENT_BYTES, payload_digest
from kvd.tiers.remote.digest_pool import DigestPool, auto_processes
from kvd.tiers.remote.digest_worker import ANSWER_BYTES, OK, OUTSIDE, REQUEST, read_exactly

SIZE = 8 << 20
RANGES = [(0, 1), (0, 4096), (5, 10_000), (4096, SEGMENT_BYTES), (12_345, 3 * SEGMENT_BYTES + 17),
          (SIZE - 4 * SEGMENT_BYTES, 4 * SEGMENT_BYTES), (1 << 20, 4 << 20)]


@pytest.fixture
def arena(tmp_path):
    path = tmp_path / "arena"
    path.write_bytes(np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDWR)
    mem = mmap.mmap(fd, SIZE)
    os.close(fd)
    return path, np.frombuffer(mem, np.uint8)  # unmapped when the last view goes


@pytest.fixture
def pool(arena):
    p = DigestPool(arena[0], SIZE, 2, timeout_s=2.0)
    yield p
    procs = list(p.alive)
    p.close()
    assert all(proc.poll() is not None for proc in procs)


def test_the_workers_digests_are_the_libraries_from_many_threads(arena, pool):
    _, view = arena
    assert pool.started == 2
    want = {r: payload_digest(view[r[0]:r[0] + r[1]]) for r in RANGES}
    got: dict = {}

    def worker(k: int) -> None:
        for rep in range(5):
            for off, n in RANGES[k::3]:
                got[(off, n, rep)] = pool.digest(off, view[off:off + n])
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {(off, n): d for (off, n, _), d in got.items()} == want
    s = pool.stats()
    assert s["digests_in_processes"] == 5 * len(RANGES) and s["digests_in_threads"] == 0
    assert s["digest_processes"] == 2 and s["digest_processes_lost"] == 0
    view[100] ^= 1  # a changed byte changes the workers' answer: they read the file itself
    assert pool.digest(0, view[:4096]) != want[(0, 4096)]


def test_a_dead_or_hung_worker_is_dropped_and_the_caller_computes_the_same_digest(arena, pool):
    _, view = arena
    off, n = RANGES[4]
    first, second = list(pool.alive)
    first.kill()
    first.wait()
    os.kill(second.pid, signal.SIGSTOP)  # answers nothing: dropped after timeout_s
    try:
        for _ in range(2):
            assert pool.digest(off, view[off:off + n]) == payload_digest(view[off:off + n])
    finally:
        if second.poll() is None:
            os.kill(second.pid, signal.SIGCONT)
    s = pool.stats()
    assert s["digest_processes"] == 0 and s["digest_processes_lost"] == 2
    assert s["digests_in_threads"] == 2 and s["digests_in_processes"] == 0
    assert second.poll() is not None  # killed when dropped
    assert pool.digest(0, view[:10]) == payload_digest(view[:10])  # none left: in the caller


def test_ranges_outside_the_arena_are_refused_before_any_worker_sees_them(arena, pool):
    _, view = arena
    with pytest.raises(ValueError, match="outside"):
        pool.digest(SIZE - 10, view[:20])
    with pytest.raises(ValueError, match="outside"):
        pool.digest(-1, view[:20])
    assert pool.stats()["digest_processes"] == 2


def test_a_worker_refuses_ranges_past_its_file_and_ends_with_its_input_only(arena):
    path, view = arena
    proc = subprocess.Popen([sys.executable, "-m", "kvd.tiers.remote.digest_worker", str(path), str(SIZE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    try:
        proc.stdin.write(REQUEST.pack(0, 4096))  # answered once it runs: its handlers are set
        assert read_exactly(proc.stdout.fileno(), ANSWER_BYTES)[0] == OK
        proc.send_signal(signal.SIGTERM)  # a cgroup-wide stop: it stays for the daemon
        proc.send_signal(signal.SIGINT)
        for off, n, status in ((SIZE - 4096, 8192, OUTSIDE), (0, 0, OUTSIDE), (2**63, 2**63, OUTSIDE),
                               (8192, 70_000, OK)):
            proc.stdin.write(REQUEST.pack(off, n))
            reply = read_exactly(proc.stdout.fileno(), ANSWER_BYTES)
            assert reply[0] == status
            assert reply[1:] == (payload_digest(view[off:off + n]) if status == OK else bytes(16))
        proc.stdin.write(b"\x01\x02")  # half a request, then the end: it leaves, quietly
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    bad = subprocess.run([sys.executable, "-m", "kvd.tiers.remote.digest_worker", str(path)],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_a_worker_that_cannot_map_its_file_is_dropped_at_its_first_digest(tmp_path, arena):
    _, view = arena
    p = DigestPool(tmp_path / "missing", SIZE, 1, timeout_s=5.0)
    try:
        assert p.digest(0, view[:4096]) == payload_digest(view[:4096])
        assert p.stats()["digest_processes_lost"] == 1
    finally:
        p.close()


def test_auto_processes_is_one_per_four_cores_at_most_eight():
    assert [auto_processes(-1, c) for c in (1, 2, 3, 4, 16, 64)] == [0, 0, 0, 1, 4, 8]
    assert auto_processes(0, 64) == 0 and auto_processes(3, 2) == 3
