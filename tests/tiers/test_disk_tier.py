"""The disk tier end to end: a real ``kvd serve`` with ``disk_dir``, engine processes.

Covered: more than the host tier holds comes back bit-exact through the disk
(demotion, promotion); a restarted daemon serves what the old one stored; kill
-9 during heavy demotion leaves no wrong file and no temp file, and whatever is
served is right; one flipped byte is a miss and a counter, never wrong bytes;
injected ENOSPC fails demotions cleanly while the host tier keeps serving;
concurrent stores of one key leave one file; ``disk_min_hits``; one daemon per
disk_dir and the ``kvd ctl``/``kvd stats`` commands; concurrent stores and loads
under pressure never give wrong bytes.
"""

from __future__ import annotations

import multiprocessing
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import workers_data as W
import workers_disk as D
from daemons import wait_for as until
from disk_faults import SLOW_READ_S

from kvd.cli.format import format_stats
from kvd.tiers.disk import chunk_file as F

CHUNK = W.CHUNK
# 16 KiB shards: a 256 KiB host tier holds 16 chunks
SPEC = {"layout": "vllm_flash_attn", "layers": 2, "page_size": 16, "dtype": "float16",
        "heads": 2, "dim": 64, "num_pages": 65}
SHARD = 2 * 2 * CHUNK * 2 * 64 * 2
HOST = {"host_capacity": "256KiB"}


def disk_knobs(tmp_path: Path, **extra) -> dict:
    return {**HOST, "disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB", **extra}


def disk_stats(daemon) -> dict:
    return daemon.stats()["tiers"]["disk"]


def wait_recovered(daemon, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = disk_stats(daemon)
        if st["recovery"]["state"] == "done":
            return st
        time.sleep(0.05)
    raise AssertionError(f"recovery did not finish: {disk_stats(daemon)}")


def chunk_files(tmp_path: Path) -> list:
    return sorted((tmp_path / "disk").rglob("*.kvc"))


def temp_files(tmp_path: Path) -> list:
    return [p for p in (tmp_path / "disk").rglob("*") if F.TMP_MARK in p.name]


def verify_all_files(tmp_path: Path) -> int:
    """Every file under a final name verifies completely (header, length, checksum)."""
    files = F.ChunkFiles(tmp_path / "disk", direct=False)
    for path in chunk_files(tmp_path):
        head = F.read_header(path)
        files.read_into(path, head.ns, head.key, np.empty(head.length, np.uint8))
    return len(chunk_files(tmp_path))


def test_more_than_host_comes_back_bit_exact_via_disk(start_daemon, procs, tmp_path):
    d = start_daemon(**disk_knobs(tmp_path))
    rd = str(d.runtime_dir)
    count, chunks = 12, 4  # 48 chunks, three times the host tier
    assert procs.apply(D.store_seqs, (rd, SPEC, 31, count, chunks, "disk/big")) == count * chunks * CHUNK
    st = d.stats()
    host, disk = st["tiers"]["host"], st["tiers"]["disk"]
    assert host["used_bytes"] <= 256 * 1024 and host["evicted_not_on_disk"] == 0
    assert disk["chunks"] == count * chunks and disk["demotions"] == count * chunks
    assert disk["write_bytes"] == count * chunks * SHARD and disk["io_errors"] == 0
    got = procs.apply(D.load_seqs, (rd, SPEC, 31, count, chunks, "disk/big"))
    assert got == [(chunks * CHUNK, chunks * CHUNK)] * count
    st = d.stats()
    assert st["tiers"]["disk"]["promotions"] >= count * chunks - 16
    assert st["tiers"]["disk"]["read_bytes"] >= (count * chunks - 16) * SHARD
    assert st["disk_hits"] > 0 and st["errors"] == 0
    assert d.stop() == 0


def test_restart_serves_chunks_stored_before(start_daemon, procs, tmp_path):
    d = start_daemon(**disk_knobs(tmp_path))
    rd = str(d.runtime_dir)
    assert procs.apply(D.store_seqs, (rd, SPEC, 41, 4, 3, "disk/restart")) == 12 * CHUNK
    assert d.stop() == 0
    d2 = start_daemon(**disk_knobs(tmp_path))
    st = wait_recovered(d2)
    assert st["recovery"]["chunks"] == 12 and st["recovery"]["removed"] == 0
    assert st["chunks"] == 12 and st["used_bytes"] == 12 * F.file_size(SHARD)
    got = procs.apply(D.load_seqs, (str(d2.runtime_dir), SPEC, 41, 4, 3, "disk/restart"))
    assert got == [(3 * CHUNK, 3 * CHUNK)] * 4
    assert "disk recovery: 12 chunks" in d2.log()


def test_kill_9_during_demotion_then_restart(start_daemon, procs, tmp_path):
    # watermark 0.1: every chunk stored is demoted at once; one IO thread: a queue builds up
    knobs = disk_knobs(tmp_path, host_capacity="512KiB", disk_io_threads=1,
                       disk_high_watermark=0.1)
    d = start_daemon(**knobs)
    rd = str(d.runtime_dir)
    # no flushes: the demoter is busy while the stores go on; kill it in the middle
    job = procs.apply_async(D.store_seqs, (rd, SPEC, 51, 16, 4, "disk/kill", False, 2.0))
    deadline = time.monotonic() + 20
    while disk_stats(d)["writes"] < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert disk_stats(d)["writes"] >= 8
    d.stop(signal.SIGKILL)
    try:
        job.get(30)
    except Exception:  # the storer sees the daemon vanish; that is the point
        pass
    stale = F.chunk_path(tmp_path / "disk", bytes(16), bytes(16)).with_suffix(".kvc.tmp-1-dead-0")
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"half a chunk")  # what a crash mid-write leaves
    d2 = start_daemon(**knobs)
    st = wait_recovered(d2)
    assert temp_files(tmp_path) == [] and st["recovery"]["temp_removed"] >= 1
    assert verify_all_files(tmp_path) == st["chunks"] > 0
    got = procs.apply(D.load_seqs, (str(d2.runtime_dir), SPEC, 51, 16, 4, "disk/kill"))
    # each prefix stops at the first chunk the kill left undemoted (demotion order is not
    # prefix order across sequences); the oldest chunks went first, so some load; load_seqs
    # checks every loaded byte
    assert sum(loaded for _, loaded in got) > 0
    assert d2.stats()["tiers"]["disk"]["checksum_failures"] == 0


def test_flipped_byte_is_a_miss_never_wrong_bytes(start_daemon, procs, tmp_path):
    d = start_daemon(**disk_knobs(tmp_path))
    rd = str(d.runtime_dir)
    assert procs.apply(D.store_seqs, (rd, SPEC, 61, 1, 4, "disk/flip")) == 4 * CHUNK
    assert d.control("clear")["dropped"] == 4  # host copies gone: only the disk holds them
    files = chunk_files(tmp_path)
    assert len(files) == 4
    victim = files[0]  # some chunk of the sequence: the load stops before it
    with open(victim, "r+b") as f:
        f.seek(F.HEADER_BYTES + 1234)
        b = f.read(1)
        f.seek(F.HEADER_BYTES + 1234)
        f.write(bytes([b[0] ^ 0x40]))
    (hit, loaded), = procs.apply(D.load_seqs, (rd, SPEC, 61, 1, 4, "disk/flip"))
    assert hit == 4 * CHUNK and loaded < 4 * CHUNK  # bit-exact up to the bad chunk (checked)
    st = disk_stats(d)
    assert st["checksum_failures"] == 1 and st["chunks"] == 3 and not victim.exists()
    (hit, loaded), = procs.apply(D.load_seqs, (rd, SPEC, 61, 1, 4, "disk/flip"))
    assert hit == loaded < 4 * CHUNK and disk_stats(d)["checksum_failures"] == 1


def test_enospc_fails_demotion_cleanly_host_keeps_serving(start_daemon, procs, tmp_path):
    d = start_daemon(faults="enospc", **disk_knobs(tmp_path))
    rd = str(d.runtime_dir)
    assert procs.apply(D.store_seqs, (rd, SPEC, 71, 3, 4, "disk/full")) == 12 * CHUNK
    st = disk_stats(d)
    assert st["enospc"] >= 12 and st["demotions_failed"] >= 12 and st["chunks"] == 0
    assert st["used_bytes"] == 0 and st["queued_writes"] == 0
    assert chunk_files(tmp_path) == [] and temp_files(tmp_path) == []
    got = procs.apply(D.load_seqs, (rd, SPEC, 71, 3, 4, "disk/full"))
    assert got == [(4 * CHUNK, 4 * CHUNK)] * 3  # 12 chunks fit in the host tier
    assert d.stats()["errors"] == 0
    assert d.stop() == 0


def test_concurrent_stores_of_one_key_leave_one_file(start_daemon, procs, tmp_path):
    d = start_daemon(**disk_knobs(tmp_path))
    rd = str(d.runtime_dir)
    for round_ in range(2):  # second round: host cleared, disk already has every key
        jobs = [procs.apply_async(D.store_seqs, (rd, SPEC, 81, 2, 4, "disk/same"))
                for _ in range(4)]
        assert [j.get(60) for j in jobs] == [8 * CHUNK] * 4
        d.control("flush_disk")
        assert len(chunk_files(tmp_path)) == 8 and temp_files(tmp_path) == []
        d.control("clear")
    got = procs.apply(D.load_seqs, (rd, SPEC, 81, 2, 4, "disk/same"))
    assert got == [(4 * CHUNK, 4 * CHUNK)] * 2
    assert d.control("clear_disk")["deleted"] == 8 and chunk_files(tmp_path) == []


def test_min_hits_demotes_only_chunks_hit_before(start_daemon, procs, tmp_path):
    """The demoter (4 of 16 chunks: above a 0.1 watermark) skips chunks never looked up,
    then takes those looked up once (an operator's flush writes all: test_disk_flush.py)."""
    d = start_daemon(**disk_knobs(tmp_path, disk_min_hits=1, disk_high_watermark=0.1))
    rd = str(d.runtime_dir)
    assert procs.apply(D.store_seqs, (rd, SPEC, 91, 2, 2, "disk/hits", False)) == 4 * CHUNK
    until(lambda: disk_stats(d)["demotions_skipped_cold"] == 4, 10, "4 cold chunks skipped")
    assert disk_stats(d)["chunks"] == 0
    procs.apply(D.load_seqs, (rd, SPEC, 91, 1, 2, "disk/hits"))  # one lookup of sequence 0
    until(lambda: disk_stats(d)["chunks"] == 2, 10, "the 2 chunks looked up on disk")
    time.sleep(0.3)  # several demoter passes: sequence 1 stays off disk
    assert disk_stats(d)["chunks"] == 2


def test_one_daemon_per_disk_dir_and_cli(start_daemon, tmp_path):
    d = start_daemon(**disk_knobs(tmp_path))
    other = start_daemon(wait=False, **disk_knobs(tmp_path))
    assert other.proc.wait(30) == 1
    assert "another kvd daemon uses this disk_dir" in other.log()
    assert "allocating the host tier" not in other.log()  # found before the expensive part
    rd = ["--runtime-dir", str(d.runtime_dir)]
    for args in (["ctl", "flush-disk"], ["ctl", "clear-disk"], ["stats"]):
        out = subprocess.run([sys.executable, "-m", "kvd", *args, *rd], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0, out.stderr
    assert "disk: demotions 0" in out.stdout and "recovery done" in out.stdout
    assert d.stop() == 0


def test_concurrent_stores_and_loads_under_pressure_never_wrong_bytes(start_daemon, procs,
                                                                        tmp_path):
    """4 engines store 128 chunks at once into a 32-chunk host tier with no flushes (some are
    lost, counted), then each loads another's sequences while the others do too: whatever
    is loaded is bit-exact (checked in the workers) and much of it comes from disk."""
    d = start_daemon(**disk_knobs(tmp_path, host_capacity="512KiB", disk_high_watermark=0.5))
    rd = str(d.runtime_dir)
    seeds = [101, 102, 103, 104]
    jobs = [procs.apply_async(D.store_seqs, (rd, SPEC, sd, 8, 4, "disk/many", False))
            for sd in seeds]
    assert [j.get(60) for j in jobs] == [8 * 4 * CHUNK] * 4
    jobs = [procs.apply_async(D.load_seqs, (rd, SPEC, sd, 8, 4, "disk/many")) for sd in seeds]
    loaded = sum(n for j in jobs for _, n in j.get(60))
    st = d.stats()
    print(f"loaded {loaded // CHUNK} of 128 chunks; evicted before reaching disk "
          f"{st['tiers']['host']['evicted_not_on_disk']}; demotions "
          f"{st['tiers']['disk']['demotions']}, promotions {st['tiers']['disk']['promotions']}")
    assert loaded > 0 and st["errors"] == 0
    assert st["tiers"]["disk"]["demotions"] > 0 and st["tiers"]["disk"]["checksum_failures"] == 0
    assert d.stop() == 0


def test_gds_unavailable_falls_back_to_the_host_path_with_a_log_line(start_daemon, procs, tmp_path):
    """Without the CUDA backend (``gpu = off`` here; CI has no GPU and no KvikIO anyway)
    ``disk_gds`` says why in one line and loads still work through the host tier."""
    d = start_daemon(**disk_knobs(tmp_path, disk_gds="true", gpu="off"))
    rd = str(d.runtime_dir)
    assert procs.apply(D.store_seqs, (rd, SPEC, 61, 8, 4, "disk/gds-fallback")) == 32 * CHUNK
    got = procs.apply(D.load_seqs, (rd, SPEC, 61, 8, 4, "disk/gds-fallback"))
    assert got == [(4 * CHUNK, 4 * CHUNK)] * 8
    disk = disk_stats(d)
    assert disk["gds"] is None and disk["promotions"] > 0
    snap = d.stats()  # the `kvd stats` table, with the GDS line a GPU machine would show
    snap["tiers"]["disk"]["gds"] = {"mode": "gds", "gpus": [0], "direct_loads": 3,
                                    "direct_chunks": 12, "direct_bytes": 3 << 20, "fallbacks": 1}
    assert "gds: gds  loads 3  chunks 12 (3.0 MiB)  fallbacks 1" in format_stats(snap)
    assert ("disk_gds is on but GPU Direct Storage is unavailable: the CUDA backend is off"
            in d.log())
    assert d.stop() == 0


def tmpfs_wrapper(mount_dir: Path, size: str, meanwhile: str = "") -> list | None:
    """A command prefix that runs the daemon with a ``size``-limited tmpfs on
    ``mount_dir`` (a private mount namespace; ``meanwhile``: a shell command run in the
    background there, ``$0`` the mount), or None where that is not allowed."""
    script = f'mount -t tmpfs -o size={size} kvd-test "$0"'
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(mount_dir)],
                           capture_output=True, timeout=10)
    if probe.returncode != 0:
        return None
    background = f" && {{ ( {meanwhile} ) & }}" if meanwhile else ""
    return ["unshare", "-rm", "sh", "-c", script + background + ' && exec "$@"', str(mount_dir)]


def test_full_filesystem_fails_demotions_cleanly(start_daemon, procs, tmp_path):
    """A real, small filesystem runs out of space: demotions fail with ENOSPC and are
    counted, what is on disk stays correct, the host tier keeps serving. The 512 KiB
    tmpfs has room for disk_capacity (448 KiB) at start-up, then another writer takes
    400 KiB of it once the daemon serves."""
    disk, run = tmp_path / "disk", tmp_path / "run"
    disk.mkdir()
    filler = (f'for _ in $(seq 600); do [ -S "{run}/control.sock" ] && break; sleep 0.05; done; '
              f'head -c 400k /dev/zero > "$0/filler"; touch "{tmp_path / "filled"}"')
    wrapper = tmpfs_wrapper(disk, "512k", filler)
    if wrapper is None:
        pytest.skip("cannot mount a size-limited tmpfs here (unshare -rm refused); "
                    "test_enospc_fails_demotion_cleanly_host_keeps_serving injects ENOSPC instead")
    d = start_daemon(run, wrapper=wrapper, **disk_knobs(tmp_path, disk_capacity="448KiB"))
    until((tmp_path / "filled").exists, 10, "the other writer")
    rd = str(d.runtime_dir)
    assert procs.apply(D.store_seqs, (rd, SPEC, 91, 12, 4, "disk/tmpfs")) == 48 * CHUNK
    st = disk_stats(d)
    assert st["enospc"] >= 1 and st["demotions_failed"] >= 1, st
    assert 0 < st["chunks"] < 48 and st["used_bytes"] <= 512 * 1024 and st["queued_writes"] == 0
    got = procs.apply(D.load_seqs, (rd, SPEC, 91, 12, 4, "disk/tmpfs"))  # bit-exact where loaded
    assert sum(loaded for _, loaded in got) >= st["chunks"] * CHUNK // 2
    assert disk_stats(d)["checksum_failures"] == 0
    # the disk is still full: new chunks go to the host tier and come back from there
    assert procs.apply(D.store_seqs, (rd, SPEC, 92, 2, 4, "disk/tmpfs2")) == 8 * CHUNK
    assert procs.apply(D.load_seqs, (rd, SPEC, 92, 2, 4, "disk/tmpfs2")) == [(4 * CHUNK, 4 * CHUNK)] * 2
    assert d.stats()["errors"] == 0
    assert d.stop() == 0


def test_client_killed_during_a_disk_load_is_reaped_and_nothing_breaks(start_daemon, procs,
                                                                        tmp_path):
    """The engine dies while its load waits for a (slow) disk read. Reaping closes the
    registration only once the request holding its turn let go (its pool stays mapped until
    then), and the load, finding its registration closing after the read, copies nothing."""
    d = start_daemon(faults="slow_read", **disk_knobs(tmp_path, client_timeout_s=1.0))
    rd = str(d.runtime_dir)
    ctx = multiprocessing.get_context("spawn")
    report, child_end = ctx.Pipe(duplex=False)
    engine = ctx.Process(target=D.slow_loader, args=(rd, SPEC, 95, child_end), daemon=True)
    engine.start()
    child_end.close()
    try:
        assert report.poll(30) and report.recv() == "loading"
        time.sleep(0.3)  # the load is now waiting on the disk read
        engine.kill()
        engine.join(10)
        deadline = time.monotonic() + SLOW_READ_S + 10
        while d.stats()["clients"] and time.monotonic() < deadline:
            time.sleep(0.05)
        st = d.stats()
        assert st["clients"] == 0 and st["registrations"] == 0, "the dead engine was not reaped"
        assert d.proc.poll() is None and st["tiers"]["disk"]["promotions"] == 2
        assert st["chunks_loaded"] == 0  # the load never copied into the closing pool
        host = st["tiers"]["host"]
        assert host["entries"] == host["chunks"] == 2, host
        assert d.control("clear")["kept_in_use"] == 0  # the load's pins were released
        assert "copy failed" not in d.log() and "could not start" not in d.log()  # no copy tried
    finally:
        if engine.is_alive():
            engine.kill()
        for leftover in Path("/dev/shm").glob(f"kvd-*-{engine.pid}-*"):  # a killed engine's files
            leftover.unlink()
    assert procs.apply(D.store_seqs, (rd, SPEC, 96, 1, 2, "disk/after")) == 2 * CHUNK
    assert d.stop() == 0
