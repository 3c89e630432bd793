"""The shared-memory files a dead client left: removed once nothing holds them.

A client creates its pool and flag files in ``shm_dir`` and flocks them for its whole life
(kvd_client.shm); it unlinks them on a clean exit, and a later client removes dead ones it
finds. An engine killed (vLLM 0.34 SIGKILLs its engine core at shutdown) leaves them, often
gigabytes, until then. ``identify`` records, at registration, each file the daemon mapped
(path, device, inode); ``remove_abandoned``, when the daemon reaps a client it lost, unlinks
each file still the same inode whose lock is free (no live process holds it), and leaves
the rest (a live holder, another user's file in sticky /dev/shm). Never follows a link.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def identify(paths) -> tuple:
    """(path, st_dev, st_ino) of each regular file in ``paths`` (as the daemon mapped them)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        out.append((str(path), st.st_dev, st.st_ino))
    return tuple(out)


def remove_abandoned(files) -> int:
    """Unlink the files of ``identify`` nobody holds any more; how many were removed."""
    return sum(_remove(path, dev, ino) for path, dev, ino in files)


def _remove(path: str, dev: int, ino: int) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False  # gone already, or replaced by a link
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (dev, ino):
            return False  # another file under that name now
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        Path(path).unlink()
        return True
    except (BlockingIOError, PermissionError, FileNotFoundError):
        return False  # held by a live process, or not ours to remove
    finally:
        os.close(fd)
