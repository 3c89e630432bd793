"""Shared fixtures: a real ``kvd serve`` in a subprocess, on a private runtime dir.

``daemon`` starts one with small defaults (chunk of 16 tokens, 64 MiB host
tier, fast heartbeats); ``start_daemon(**knobs)`` starts more or differently
configured ones (``env``: variables added to its environment;
``faults="enospc", ...``: a daemon whose disk IO fails as asked,
tests/fault_daemon.py with the doubles of tests/disk_faults.py);
``redis_server`` a real redis-server on loopback (skipped without one). Client code
runs in separate processes through ``procs`` (a spawn-context
multiprocessing pool), as engines would. ``no_shm_leaks`` fails the run when
it leaves ``kvd-*`` files in /dev/shm (under ``pytest -n``: checked by xdist's
controller once every worker has ended; tests/xdist_groups.py says which
tests share a worker).
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

pytest_plugins = ["skip_guard"]  # --only-skips REGEX (tests/skip_guard.py)
_SHM_KEY = pytest.StashKey[tuple]()  # xdist's controller: /dev/shm before, the tags' dir


def _kvd_shm_entries() -> set[str]:
    return {p.name for p in SHM.glob("kvd-*")} if SHM.is_dir() else set()


def _owner_alive(name: str) -> bool:
    """Whether the process a ``kvd-*`` name carries (pool ``kvd-pool-<pid>-...``, arena
    ``...-<pid>`` of releases before warm restart) still runs: another test run's live files
    are no leak. Arenas ``kvd-arena-<tag>[.index]`` carry no pid: see ``_ours``."""
    m = re.search(r"^kvd-arena-[0-9a-f]+-(\d+)$", name) or re.search(r"^kvd-\w+-(\d+)-", name)
    return bool(m) and pids_alive(int(m.group(1)))


def _ours(name: str, tags: set[str]) -> bool:
    """An arena is this session's when its runtime dir was (``tags``; other test runs on the
    same machine kill daemons too); pools and flag pages carry only a pid, so all count."""
    m = re.match(r"^kvd-arena-([0-9a-f]+)(-\d+|\.index)?$", name)
    return m is None or m.group(1) in tags


def _leaked(before: set[str], tags: set[str]) -> list[str]:
    """The ``kvd-*`` entries new since ``before`` that no live process owns and that are
    ours (``tags``: the instance tags of our daemons' runtime dirs); removed, and named."""
    leaked = sorted(n for n in _kvd_shm_entries() - before
                    if not _owner_alive(n) and _ours(n, tags))
    for name in leaked:
        (SHM / name).unlink(missing_ok=True)
    return leaked


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks(request):
    """The suite leaves no new ``kvd-*`` entry in /dev/shm (arenas, pools, flag pages). Under
    ``pytest -n`` (xdist) a worker only hands its daemons' tags to the controller, which
    checks once every worker has ended (pytest_sessionfinish): a worker ending early must
    not take the files of a test still running on another for leaks."""
    tags_dir = getattr(request.config, "workerinput", {}).get("kvd_tags_dir")
    before = _kvd_shm_entries()
    yield
    if tags_dir:
        worker = request.config.workerinput["workerid"]
        (Path(tags_dir) / worker).write_text("\n".join(sorted(SESSION_TAGS)))
        return
    leaked = _leaked(before, SESSION_TAGS)
    assert not leaked, f"the test suite left these in /dev/shm: {leaked}"


def _controller(config) -> bool:
    return not hasattr(config, "workerinput") and config.pluginmanager.hasplugin("dsession")


def pytest_sessionstart(session):
    if _controller(session.config):
        session.config.stash[_SHM_KEY] = (_kvd_shm_entries(), tempfile.mkdtemp(prefix="kvd-tags-"))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # xdist: the controller tells each worker where its tags go
    node.workerinput["kvd_tags_dir"] = node.config.stash[_SHM_KEY][1]


def pytest_sessionfinish(session):
    if not _controller(session.config) or _SHM_KEY not in session.config.stash:
        return
    before, tags_dir = session.config.stash[_SHM_KEY]
    tags = {t for f in Path(tags_dir).iterdir() for t in f.read_text().split()}
    shutil.rmtree(tags_dir, ignore_errors=True)
    leaked = _leaked(before, tags)
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.write("\n")
        reporter.write_line(f"FAILED: the test suite left these in /dev/shm: {leaked}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n N --dist loadgroup``: the groups of tests/xdist_groups.py."""
    if config.getvalue("dist") == "loadgroup":
        from xdist_groups import GroupScheduling

        return GroupScheduling(config, log)
    return None


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
