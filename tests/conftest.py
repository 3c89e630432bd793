"""Shared fixtures: a real ``kvd serve`` in a subprocess, on a private runtime dir.

``daemon`` starts one with small defaults (chunk of 16 tokens, 64 MiB host
tier, fast heartbeats); ``start_daemon(**knobs)`` starts more or differently
configured ones (``env``: variables added to its environment;
``faults="enospc", ...``: a daemon whose disk IO fails as asked,
tests/fault_daemon.py with the doubles of tests/disk_faults.py);
``redis_server`` a real redis-server on loopback (skipped without one). Client code
runs in separate processes through ``procs`` (a spawn-context
multiprocessing pool), as engines would.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from daemons import SESSION_TAGS, DaemonProc
from remote_servers import RedisServer
from shm_files import SHM

from kvd_protocol.runtime import instance_tag


def _kvd_shm_entries() -> set[str]:
    return {p.name for p in SHM.glob("kvd-*")} if SHM.is_dir() else set()


def _owner_alive(name: str) -> bool:
    """Whether the process a ``kvd-*`` name carries (pool ``kvd-pool-<pid>-...``, arena
    ``...-<pid>`` of releases before warm restart) still runs: another test run's live files
    are no leak. Arenas ``kvd-arena-<tag>[.index]`` carry no pid: see ``_ours``."""
    m = re.search(r"^kvd-arena-[0-9a-f]+-(\d+)$", name) or re.search(r"^kvd-\w+-(\d+)-", name)
    return bool(m) and pids_alive(int(m.group(1)))



def _ours(name: str) -> bool:
    """An arena is this session's when its runtime dir was (other test runs on the same
    machine kill daemons too); pools and flag pages carry only a pid, so all count."""
    m = re.match(r"^kvd-arena-([0-9a-f]+)(-\d+|\.index)?$", name)
    return m is None or m.group(1) in SESSION_TAGS


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks():
    """The suite leaves no new ``kvd-*`` entry in /dev/shm (arenas, pools, flag pages)."""
    before = _kvd_shm_entries()
    yield
    leaked = sorted(n for n in _kvd_shm_entries() - before if not _owner_alive(n) and _ours(n))
    for name in leaked:
        (SHM / name).unlink(missing_ok=True)
    assert not leaked, f"the test suite left these in /dev/shm: {leaked}"


@pytest.fixture
def start_daemon():
    base = Path(tempfile.mkdtemp(prefix="kvd-t-", dir="/tmp"))
    started = []

    def start(runtime_dir: Path | None = None, wait: bool = True, wrapper: list | None = None,
              env: dict | None = None, faults: str = "", **knobs) -> DaemonProc:
        d = DaemonProc(runtime_dir or base / f"run{len(started)}", knobs, wrapper, env, faults)
        SESSION_TAGS.add(instance_tag(d.runtime_dir))
        started.append(d)
        return d.start(wait)

    yield start
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()
    keep = os.environ.get("KVD_TEST_LOG_DIR")  # e.g. on the GPU machine: logs come back
    for d in started if keep else ():
        Path(keep).mkdir(parents=True, exist_ok=True)
        if d.log_path.exists():
            shutil.copy(d.log_path, Path(keep) / f"{base.name}-{d.log_path.name}")
    for d in started:  # every daemon keeps its host tier for the next start (warm_restart)
        d.remove_host_tier()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def daemon(start_daemon):
    d = start_daemon()
    yield d
    code = d.stop()
    assert code == 0, f"kvd exited with {code}:\n{d.log()}"


@pytest.fixture
def redis_server():
    """A real redis-server (or valkey-server) on loopback (tests/remote_servers.py); the
    test skips, saying why, where none is installed."""
    why = RedisServer.missing()
    if why:
        pytest.skip(why)
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def procs():
    """A pool of spawned client processes (not forked: zmq and mmaps do not fork)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        yield pool


def pids_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
