"""The runtime directory on the daemon's side: create it, lock it, reclaim leftovers.

Creates the directory (0700; with ``access_group`` 0750 and sockets 0660 of that group)
holding ``kvd.sock``, ``control.sock`` and ``kvd.lock`` (names: kvd_protocol.runtime). The
flock lets one daemon serve a directory and dies with it, so a daemon that gets it knows
leftover sockets are stale. A directory that cannot be used raises
``ConfigError("runtime_dir", ...)``: one line, exit status 2.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from kvd_protocol.errors import ConfigError


def prepare_runtime_dir(runtime_dir: Path, group: int | None = None) -> None:
    """Create the directory 0700 (0750 of ``group``); refuse one that is not ours."""
    mode = 0o700 if group is None else 0o750
    try:
        if not os.path.lexists(runtime_dir):
            runtime_dir.mkdir(mode=mode, parents=True, exist_ok=True)
        st = os.lstat(runtime_dir)
    except OSError as exc:
        raise ConfigError("runtime_dir", f"cannot create {runtime_dir}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError("runtime_dir", f"{runtime_dir} is not a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError("runtime_dir", f"{runtime_dir} belongs to uid {st.st_uid}, not to "
                          f"uid {os.geteuid()} that kvd runs as (chown {os.geteuid()} "
                          f"{runtime_dir}, or use another runtime_dir)")
    if not os.access(runtime_dir, os.W_OK | os.X_OK):
        raise ConfigError("runtime_dir", f"{runtime_dir} is not writable by uid {os.geteuid()}")
    if group is not None and st.st_gid != group:
        _chgrp(runtime_dir, group)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(runtime_dir, mode)


def share_socket(path: Path, group: int | None) -> None:
    """Give a socket bound under umask 077 (0600) to ``group``, 0660; nothing without a group."""
    if group is not None:
        _chgrp(path, group)
        os.chmod(path, 0o660)


def _chgrp(path: Path, group: int) -> None:
    try:
        os.chown(path, -1, group, follow_symlinks=False)
    except PermissionError:
        raise RuntimeError(f"cannot give {path} to group {group} (access_group): the daemon's "
                           "user must be a member of it") from None


class InstanceBusy(RuntimeError):
    """Another process holds the runtime dir's lock (``owner``: its pid as it wrote it)."""

    def __init__(self, runtime_dir: Path, owner: str):
        super().__init__(f"another kvd (pid {owner}) is serving {runtime_dir}; stop it or pass a "
                         "different --runtime-dir")
        self.owner = owner


class InstanceLock:
    """flock on <runtime_dir>/kvd.lock holding the owner's pid. ``release`` removes the file
    (a clean stop leaves no lock behind; a crash does, and the next daemon takes it). Since a
    file can be removed between another daemon's open and its flock, a lock is held only on
    the file that still has the name: a lock taken on a removed one is dropped and taken again."""

    def __init__(self, runtime_dir: Path):
        self.path = runtime_dir / "kvd.lock"
        self.fd = -1

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise InstanceBusy(self.path.parent, owner) from None
            if self._names(fd):
                break
            os.close(fd)  # its owner removed it as it stopped: lock the file of that name now
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            if self._names(self.fd):  # still locked: no other daemon can hold this name
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = -1

    def _names(self, fd: int) -> bool:
        """Whether ``fd`` is the file ``self.path`` names."""
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def reclaim_stale(runtime_dir: Path, shm_dir: Path, tag: str) -> list[str]:
    """Remove the sockets a dead daemon left, and arenas named by pid (``kvd-arena-<tag>-<pid>``,
    made by releases before warm restart: kvd.server.host_tier adopts ``kvd-arena-<tag>``).
    Call only under the lock."""
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
