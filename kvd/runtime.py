"""Runtime directory, instance lock and reclaiming what a dead daemon left.

The runtime directory is resolved the same way by ``kvd serve``, every
other ``kvd`` command and the client library: an explicit value, else
$KVD_RUNTIME_DIR, $RUNTIME_DIRECTORY (systemd), $XDG_RUNTIME_DIR/kvd,
/run/kvd for root, /tmp/kvd-<uid>. It is created with mode 0700 and holds
``kvd.sock``, ``control.sock`` and ``kvd.lock``. The lock (flock) lets one
daemon serve a directory; it is released by the kernel when the daemon
dies, so a new daemon that gets it knows every leftover is stale.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
from pathlib import Path


def resolve_runtime_dir(explicit: str | None = None, env=None) -> Path:
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit)
    for var in ("KVD_RUNTIME_DIR", "RUNTIME_DIRECTORY"):
        if env.get(var):
            # systemd may list several directories separated by ':'
            return Path(env[var].split(":")[0])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "kvd"
    if os.geteuid() == 0:
        return Path("/run/kvd")
    return Path(f"/tmp/kvd-{os.geteuid()}")


def engine_endpoint(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir / 'kvd.sock'}"


def control_endpoint(runtime_dir: Path) -> str:
    return f"ipc://{runtime_dir / 'control.sock'}"


def instance_tag(runtime_dir: Path) -> str:
    """Short stable name of a runtime dir, used to name its shared memory."""
    return hashlib.sha256(str(runtime_dir.resolve()).encode()).hexdigest()[:12]


def prepare_runtime_dir(runtime_dir: Path) -> None:
    """Create the directory 0700; refuse one that others can enter."""
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(runtime_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"runtime dir {runtime_dir} is not a directory")
    if st.st_uid != os.geteuid():
        raise RuntimeError(f"runtime dir {runtime_dir} belongs to uid {st.st_uid}, not to us")
    if st.st_mode & 0o077:
        os.chmod(runtime_dir, 0o700)


class InstanceLock:
    """flock on <runtime_dir>/kvd.lock holding the owner's pid."""

    def __init__(self, runtime_dir: Path):
        self.path = runtime_dir / "kvd.lock"
        self.fd = -1

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RuntimeError(f"another kvd (pid {owner}) is serving {self.path.parent}; "
                               "stop it or pass a different --runtime-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def reclaim_stale(runtime_dir: Path, shm_dir: Path, tag: str) -> list[str]:
    """Remove sockets and arenas a dead daemon left. Call only under the lock."""
    removed = []
    for name in ("kvd.sock", "control.sock"):
        p = runtime_dir / name
        if p.exists() or p.is_symlink():
            p.unlink()
            removed.append(str(p))
    for p in shm_dir.glob(f"kvd-arena-{tag}-*"):
        p.unlink(missing_ok=True)
        removed.append(str(p))
    return removed
