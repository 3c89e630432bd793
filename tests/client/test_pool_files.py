"""SharedKVPool's files: a pool locks its file for its lifetime, and a new pool removes
only files whose lock it can take -- across pid namespaces (containers sharing /dev/shm),
where the owner's pid means nothing."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvd_client import SharedKVPool

GEOMETRY = ("vllm_flash_attn", 1, 4, 4, 1, 8, "float16")

# Runs as pid 1 of a new pid namespace: forks until a child gets the wanted pid (one that
# is free in the test's namespace), which creates a pool, prints its path, and keeps it
# until its stdin closes.
_OWNER = """
import os, sys
from kvd_client import SharedKVPool
want, shm = int(sys.argv[1]), sys.argv[2]
while True:
    pid = os.fork()
    if pid == 0:
        if os.getpid() != want:
            os._exit(0)
        pool = SharedKVPool("vllm_flash_attn", 1, 4, 4, 1, 8, "float16", shm_dir=shm)
        print(pool.path, flush=True)
        sys.stdin.read()
        pool.close()
        os._exit(0)
    os.waitpid(pid, 0)
    if pid >= want:
        break
"""


def _free_pid() -> int | None:
    """A small pid nothing in this namespace uses (pids grow, so it stays free for a while)."""
    used = {int(n) for n in os.listdir("/proc") if n.isdigit()}
    return next((p for p in range(2, 400) if p not in used), None)


def _wait_unlocked(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, "the killed owner still holds its lock"
                time.sleep(0.02)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def foreign_owner(tmp_path):
    """A pool owned by a process of another pid namespace, whose pid is free in ours."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here (unshare: {probe.stderr.strip()})")
    want = _free_pid()
    if want is None:
        pytest.skip("no small pid is free in this namespace")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c",
                             _OWNER, str(want), str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        path = Path(proc.stdout.readline().strip())
        assert path.name.startswith(f"kvd-pool-{want}-") and path.exists()
        if _alive(want):
            pytest.skip(f"pid {want} was taken in this namespace meanwhile")
        yield proc, path
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(30)


def test_a_live_pool_of_another_pid_namespace_is_kept(foreign_owner, tmp_path):
    proc, path = foreign_owner
    mine = SharedKVPool(*GEOMETRY, shm_dir=str(tmp_path))  # cleans up before it creates
    try:
        assert path.exists(), "a live pool of another container was deleted"
    finally:
        mine.close()
    proc.stdin.close()  # its owner closes it: gone
    assert proc.wait(30) == 0
    assert not path.exists()


def test_a_pool_whose_owner_died_is_removed(foreign_owner, tmp_path):
    proc, path = foreign_owner
    proc.send_signal(signal.SIGKILL)  # unshare, then its child (init of the namespace), die
    proc.wait(30)
    _wait_unlocked(path)  # the namespace's processes die a moment later
    assert path.exists()  # killed: nobody closed it
    mine = SharedKVPool(*GEOMETRY, shm_dir=str(tmp_path))
    try:
        assert not path.exists() and mine.path.exists()
    finally:
        mine.close()
    assert not list(tmp_path.iterdir())


def test_a_pool_holds_its_lock_until_closed(tmp_path):
    pool = SharedKVPool(*GEOMETRY, shm_dir=str(tmp_path))
    other = SharedKVPool(*GEOMETRY, shm_dir=str(tmp_path))
    try:
        assert pool.path.exists() and other.path.exists()
        # a copy of the file under a dead pid's name, unlocked: removed by the next pool
        stale = tmp_path / "kvd-pool-999999999-00aa"
        stale.write_bytes(b"\0" * 16)
        SharedKVPool(*GEOMETRY, shm_dir=str(tmp_path)).close()
        assert not stale.exists() and pool.path.exists() and other.path.exists()
    finally:
        pool.close()
        other.close()
    assert not list(tmp_path.iterdir())
