"""Files in shared memory that the client creates for the daemon to map.

``create(prefix, size, shm_dir, group)`` makes ``<shm_dir>/<prefix>-<pid>-<hex>``
(mode 0600; with ``group``, 0660 of that group, set before any byte is in
it, so a daemon running as another user of the group can map it), fully
allocated, and maps it shared. ``remove_dead_files(shm_dir, prefix)``
removes such files of processes that are gone. ``shared_group(runtime_dir)``
is the group a runtime directory is shared with (its group, when the
directory grants it access), the group the client's files need.
"""

from __future__ import annotations

import grp
import mmap
import os
import re
from pathlib import Path


def create(prefix: str, size: int, shm_dir, group: str | int | None = None) -> tuple[Path, mmap.mmap]:
    remove_dead_files(Path(shm_dir), prefix)
    path = Path(shm_dir) / f"{prefix}-{os.getpid()}-{os.urandom(6).hex()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if group is not None:  # before any byte is in it
            os.fchown(fd, -1, group if isinstance(group, int) else grp.getgrnam(group).gr_gid)
            os.fchmod(fd, 0o660)
        os.posix_fallocate(fd, 0, size)
        return path, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def shared_group(runtime_dir) -> int | None:
    try:
        st = os.stat(runtime_dir)
    except OSError:
        return None
    return st.st_gid if st.st_mode & 0o070 and st.st_uid != os.geteuid() else None


def remove_dead_files(shm_dir: Path, prefix: str) -> None:
    """Remove ``<prefix>-<pid>-<hex>`` files (pools, flag pages) of processes that are gone."""
    for p in shm_dir.glob(f"{prefix}-*-*"):
        m = re.fullmatch(re.escape(prefix) + r"-(\d+)-[0-9a-f]+", p.name)
        if m and not _alive(int(m.group(1))):
            try:
                p.unlink(missing_ok=True)
            except PermissionError:
                pass  # another user's file: theirs to remove


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
