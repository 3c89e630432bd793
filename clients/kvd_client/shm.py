"""Files in shared memory that the client creates for the daemon to map.

``ShmFile.create(prefix, size, shm_dir, group)`` makes ``<shm_dir>/<prefix>-<pid>-<hex>``
(0600, or 0660 of ``group`` set before any byte is in it), allocated (unless
``allocate=False``), mapped shared and flocked for its owner's whole life. Leftovers of dead
processes are removed (``remove_dead_files``) only when their lock can be taken: safe
across containers sharing /dev/shm. ``close`` unlinks before dropping the lock.
``shared_group(dir)`` is the group a runtime directory is shared with.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import mmap
import os
import re
from pathlib import Path


def _allocate(fd: int, size: int, shm_dir: Path) -> None:
    """posix_fallocate, with a full shm_dir said in sizes rather than a bare ENOSPC."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        st = os.statvfs(shm_dir)
        raise OSError(errno.ENOSPC, f"a shared-memory pool of {_size(size)} does not fit: {shm_dir} "
                      f"has {_size(st.f_bavail * st.f_frsize)} free (a smaller pool, or grow the "
                      "tmpfs)") from None


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class ShmFile:
    def __init__(self, path: Path, fd: int, mm: mmap.mmap):
        self.path, self._fd, self.map = path, fd, mm

    @classmethod
    def create(cls, prefix: str, size: int, shm_dir, group: str | int | None = None,
               allocate: bool = True) -> "ShmFile":
        shm_dir = Path(shm_dir)
        remove_dead_files(shm_dir, prefix)
        path, fd = _create_locked(shm_dir, prefix)
        try:
            if group is not None:  # before any byte is in it
                os.fchown(fd, -1, group if isinstance(group, int) else grp.getgrnam(group).gr_gid)
                os.fchmod(fd, 0o660)
            if allocate:
                _allocate(fd, size, shm_dir)
            else:  # the caller allocates ranges as it fills them
                os.ftruncate(fd, size)
            return cls(path, fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED))
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self.map is None:
            return
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes when it is collected
        self.map = None
        self.path.unlink(missing_ok=True)
        os.close(self._fd)  # unlinked first: no cleaner can find the file unlocked


def shared_group(runtime_dir) -> int | None:
    try:
        st = os.stat(runtime_dir)
    except OSError:
        return None
    return st.st_gid if st.st_mode & 0o070 and st.st_uid != os.geteuid() else None


def remove_dead_files(shm_dir: Path, prefix: str) -> None:
    """Remove ``<prefix>-<pid>-<hex>`` files whose owner is gone (their lock is free)."""
    for p in shm_dir.glob(f"{prefix}-*-*"):
        m = re.fullmatch(re.escape(prefix) + r"-(\d+)-[0-9a-f]+", p.name)
        if m and not _alive(int(m.group(1))):
            _remove_if_unlocked(p)


def _create_locked(shm_dir: Path, prefix: str) -> tuple[Path, int]:
    while True:
        path = shm_dir / f"{prefix}-{os.getpid()}-{os.urandom(6).hex()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a cleaner holds it for a moment at most
        if _same_file(path, fd):
            return path, fd
        os.close(fd)  # a cleaner took it between our create and our lock


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _remove_if_unlocked(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return  # vanished, a symlink, not ours to open: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)  # a live file, maybe of another pid namespace
        return
    try:
        if _same_file(path, fd):
            path.unlink(missing_ok=True)
    except PermissionError:
        pass  # another user's file in sticky /dev/shm: theirs to remove
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
