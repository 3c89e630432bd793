"""``kvd serve`` start-up: cheap checks first, an allocation a signal can stop, the config logged.

Every test runs a real ``kvd serve`` subprocess. The interrupt tests size
the host tier so its allocation takes seconds here and signal it midway:
the daemon must stop at once with one line, no traceback and no file left
in /dev/shm. The CUDA tests put a stand-in ``cupy`` package on the
daemon's PYTHONPATH (no GPU here) to see how each kind of failure while
starting the CUDA backend is reported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemons import wait_for as until
from shm_files import arena_files

from kvd.config import KNOBS

SHM = Path("/dev/shm")
BIG = 8 * 2**30  # takes seconds to allocate here (about 1 GiB/s on the 2-core CI machine)


def serve(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvd", "serve", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def wait_for(d, pattern: str, timeout: float = 30.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, d.log())
        if m:
            return m
        if d.proc.poll() is not None:
            break
        time.sleep(0.02)
    raise AssertionError(f"no {pattern!r} in the log:\n{d.log()}")


def arenas(d) -> list:
    return arena_files(d.runtime_dir)


def room_for_big() -> bool:
    st = os.statvfs(SHM)
    return st.f_bavail * st.f_frsize > BIG + 2 * 2**30


@pytest.mark.skipif(not room_for_big(), reason="needs 10 GiB free in /dev/shm")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_allocation_at_once(start_daemon, sig):
    d = start_daemon(wait=False, host_capacity=BIG)
    wait_for(d, r"allocating the host tier: 8GiB at ")
    if sig == signal.SIGINT:  # let one progress line come first
        wait_for(d, r"allocating the host tier: \d+% \([\d.]+ of 8.0 GiB\), [\d.]+ GiB/s, about")
    if "ready in" in d.log():
        pytest.skip("the allocation finished before the signal: too fast here to interrupt")
    d.proc.send_signal(sig)
    assert d.proc.wait(timeout=15) == 0
    log = d.log()
    m = re.search(rf"start-up interrupted by {sig.name} while allocating the host tier "
                  r"\((\d+)% of 8GiB done\): stopped, nothing left behind", log)
    assert m, log
    assert int(m.group(1)) < 100
    assert "Traceback" not in log and "ready in" not in log and "ERROR" not in log
    assert arenas(d) == []
    assert not (d.runtime_dir / "kvd.sock").exists()


@pytest.mark.parametrize("case", ["disk_dir_is_a_file", "runtime_dir_in_proc", "no_shm_dir",
                                  "shm_too_small", "disk_dir_uncreatable", "disk_dir_parent_missing",
                                  "disk_too_small", "no_such_group"])
def test_cheap_checks_fail_before_the_allocation(tmp_path, case):
    """One line, exit status 2, and nothing allocated (the allocation line never comes)."""
    (tmp_path / "file").write_text("")
    args = {"runtime-dir": tmp_path / "run", "host-capacity": "64MiB"}
    if case == "disk_dir_is_a_file":
        args["disk-dir"], want = tmp_path / "file", f"disk_dir: {tmp_path / 'file'} is not a directory"
    elif case == "disk_dir_uncreatable":
        args["disk-dir"], want = tmp_path / "file" / "d", "disk_dir: cannot create"
    elif case == "disk_dir_parent_missing":  # a typo in a parent: nothing is created
        args["disk-dir"] = tmp_path / "nvme-typo" / "kvd"
        want = f"disk_dir: cannot create {args['disk-dir']}: {tmp_path / 'nvme-typo'} does not exist"
    elif case == "disk_too_small":
        args["disk-dir"], args["disk-capacity"] = tmp_path / "disk", "1024TiB"
        want = f"disk_capacity: a disk tier of 1048576.00 GiB does not fit: {tmp_path / 'disk'} has "
    elif case == "no_such_group":  # systemd's unit names group kvd: not made yet
        args["access-group"] = "kvd-no-such-group"
        want = "access_group: no such group 'kvd-no-such-group' (create it: groupadd"
    elif case == "runtime_dir_in_proc":
        args["runtime-dir"], want = "/proc/kvd-test/run", "runtime_dir: cannot create /proc/kvd-test"
    elif case == "no_shm_dir":
        args["shm-dir"], want = tmp_path / "none", "shm_dir: "
    else:
        args["host-capacity"], want = "64TiB", "host_capacity: a host tier of 65536.00 GiB does not fit"
    out = serve(*[x for k, v in args.items() for x in (f"--{k}", v)])
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"config error: {want}" in errors[0], out.stderr
    assert "Traceback" not in out.stderr and "allocating" not in out.stderr
    assert not (tmp_path / "nvme-typo").exists()


def test_chunk_files_in_disk_dir_count_as_room(start_daemon, tmp_path):
    """disk_capacity above the free space starts when kvd's chunk files there make up the
    difference (a restart keeps or replaces them); without them it is refused. A sparse
    file stands for 2 GiB of chunk files; capacity is the free space plus 1 GiB."""
    disk = tmp_path / "disk"
    chunk = disk / "ab" / ("ab" * 16) / f"{'cd' * 16}.kvc"
    chunk.parent.mkdir(parents=True)
    st = os.statvfs(tmp_path)
    capacity = st.f_bavail * st.f_frsize + 2**30
    out = serve("--runtime-dir", tmp_path / "run0", "--host-capacity", "64MiB", "--disk-dir", disk,
                "--disk-capacity", capacity)
    assert out.returncode == 2 and "config error: disk_capacity: a disk tier of" in out.stderr
    with open(chunk, "wb") as f:
        f.truncate(2 * 2**30)
    d = start_daemon(disk_dir=disk, disk_capacity=capacity)
    assert d.stats()["tiers"]["disk"]["capacity_bytes"] == capacity
    assert d.stop() == 0


def test_the_config_is_logged_with_sources_before_the_allocation(start_daemon, tmp_path):
    """At info level the knobs that differ from their defaults (from a file, env or flags;
    a default set in the file is no change), and a count; at debug level every knob."""
    conf = tmp_path / "kvd.toml"
    conf.write_text("lease_max_ms = 500\nmax_clients = 1024\n")
    d = start_daemon(config=conf, env={"KVD_COPY_THREADS": "3"})
    log = d.log()
    assert f"config file {conf}" in log
    for line in ('config copy_threads = 3 (env)', 'config lease_max_ms = 500 (file)',
                 'config host_capacity = "64MiB" (flag)', 'config chunk_tokens = 16 (flag)'):
        assert line in log
    assert "config max_clients" not in log and "config log_format" not in log
    lines = [line for line in log.splitlines() if " kvd INFO config " in line]
    assert len(lines) == 1 + 8  # the file; copy_threads, lease_max_ms, 6 flags of the fixture
    summary = f"config: 8 of {len(KNOBS)} knobs differ from their defaults"
    assert log.index(summary) < log.index("allocating the host tier: 64MiB")
    assert log.index("allocating the host tier") < log.index("host tier: 64MiB at ")
    assert "host copies on 3 threads" in log
    debug = start_daemon(config=conf, log_level="debug").log()
    assert "config max_clients = 1024 (file)" in debug and "config log_format = " in debug
    auto = min(16, len(os.sched_getaffinity(0)))  # copy_threads 0 (default): a thread per CPU, <= 16
    assert f"host copies on {auto} threads" in debug


def test_a_misspelt_kvd_variable_is_one_warning_at_start(start_daemon):
    d = start_daemon(env={"KVD_HOST_CAPACTIY": "8GiB", "KVD_VLLM_PYTHON": "/x"})
    warnings = [line for line in d.log().splitlines() if "KVD_" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].endswith(" WARNING environment variable KVD_HOST_CAPACTIY sets no kvd knob "
                                "and is ignored (did you mean KVD_HOST_CAPACITY?)")
    assert d.stats()["tiers"]["host"]["capacity_bytes"] == 64 * 2**20  # the flag, not the typo


def test_json_log_lines(start_daemon):
    d = start_daemon(log_format="json")
    assert d.stop() == 0
    records = [json.loads(line) for line in d.log().splitlines()]
    assert all({"time", "level", "message"} <= set(r) for r in records)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", records[0]["time"])
    knob = next(r for r in records if r.get("knob") == "host_capacity")
    assert (knob["value"], knob["source"], knob["level"]) == (64 * 2**20, "flag", "info")
    assert records[-1]["message"] == "stopped"


FAKE_CUPY = '''
class CUDARuntimeError(RuntimeError):
    pass


class _Runtime:
    CUDARuntimeError = CUDARuntimeError

    @staticmethod
    def getDeviceCount():
        {body}


class _Cuda:
    runtime = _Runtime


cuda = _Cuda
'''


def fake_cupy(tmp_path: Path, body: str) -> dict:
    pkg = tmp_path / "fake" / "cupy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_CUPY.replace("{body}", body))
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), *sys.path])}


def test_no_gpu_turns_the_cuda_backend_off_quietly(start_daemon, tmp_path):
    env = fake_cupy(tmp_path, 'raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device")')
    d = start_daemon(gpu="auto", env=env)
    log = d.log()
    assert "CUDA backend off: CUDARuntimeError: cudaErrorNoDevice" in log
    assert "ERROR" not in log and "Traceback" not in log


def test_a_bug_while_starting_cuda_is_logged_with_its_traceback(start_daemon, tmp_path):
    """gpu = auto: an error that is not "no CUDA here" is an error with its traceback, and the
    daemon serves on the host backend; gpu = on: start-up fails."""
    env = fake_cupy(tmp_path, 'raise TypeError("a bug")')
    d = start_daemon(gpu="auto", env=env)
    assert d.control("health")["backend"] == "host"
    log = d.log()
    assert "ERROR starting the CUDA backend failed unexpectedly" in log
    assert "Traceback" in log and "TypeError: a bug" in log
    out = serve("--runtime-dir", tmp_path / "run", "--host-capacity", "64MiB", "--gpu", "on", env=env)
    assert out.returncode == 1
    assert "gpu = on but the CUDA backend is unavailable: TypeError: a bug" in out.stderr
    assert "Traceback" in out.stderr  # the bug's, logged once


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_gpu_on_without_cupy_fails_before_the_allocation(tmp_path):
    out = serve("--runtime-dir", tmp_path / "run", "--host-capacity", "64MiB", "--gpu", "on")
    assert out.returncode == 1 and "gpu = on but CuPy is not installed" in out.stderr
    assert "allocating" not in out.stderr and "Traceback" not in out.stderr


RUN_KVD_AFTER_GO = ("import sys, runpy; print('go', flush=True); sys.argv[0] = 'kvd'; "
                    "runpy.run_module('kvd', run_name='__main__')")


def test_ctrl_c_at_any_moment_of_start_up_leaves_no_traceback_and_nothing_behind(tmp_path):
    """SIGINT while modules import, while checking, allocating, binding, serving: exit 0, one
    line, no traceback, nothing left in /dev/shm, never a daemon that serves on regardless.
    Each process says "go" once the interpreter has started (a signal while Python itself
    starts is Python's to report), then runs ``kvd serve`` as ``python -m kvd`` would."""
    procs = []
    try:
        for i, delay in enumerate((0.03, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0, 1.5)):
            rd = tmp_path / f"run{i}"
            p = subprocess.Popen([sys.executable, "-c", RUN_KVD_AFTER_GO, "serve", "--runtime-dir",
                                  str(rd), "--host-capacity", "256MiB"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            assert p.stdout.readline() == "go\n"
            procs.append((p, rd, delay, time.monotonic()))
        for p, _, delay, went in procs:
            time.sleep(max(0.0, went + delay - time.monotonic()))
            p.send_signal(signal.SIGINT)
        for p, rd, _, _ in procs:
            out, _ = p.communicate(timeout=30)
            kept = arena_files(rd)
            for path in kept:
                path.unlink()
            assert p.returncode == 0 and "Traceback" not in out, out
            last = out.strip().splitlines()[-1]
            assert re.search(r"kvd: stopped by SIGINT before start-up$|start-up interrupted by "
                             r"SIGINT|kvd INFO stopped$", last), out
            # a daemon that served keeps its host tier for the next start; no other leaves any
            assert len(kept) == (2 if "kvd INFO stopped" in last else 0), (kept, out)
    finally:
        for p, _, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_open_files_limit_is_raised_to_the_hard_one(start_daemon):
    """Engines, metrics peers and disk IO each take a descriptor; a daemon started with a
    low soft limit (ulimit -n 64, hard 4096) raises it and says so."""
    d = start_daemon(wrapper=["prlimit", "--nofile=64:4096", "--"])
    limits = Path(f"/proc/{d.proc.pid}/limits").read_text()
    assert re.search(r"Max open files\s+4096\s+4096", limits), limits
    until(lambda: "open files limit raised from 64 to 4096" in d.log(), 5, "the log line")
