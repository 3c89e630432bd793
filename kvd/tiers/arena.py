"""The host arena: one shared-memory file per daemon instance.

Named ``kvd-arena-<instance tag>-<pid>`` under the shm directory, so a new
daemon of the same runtime dir can find and reclaim it after a crash. The
file is fully allocated up front (posix_fallocate: a full /dev/shm fails
here with a clear message rather than SIGBUS later) and its pages are
mapped in (MADV_POPULATE_WRITE, or a write per page on kernels before
5.14) so the request path never page-faults. Both happen in pieces of
``PIECE`` bytes: between pieces the constructor reports progress
(``on_progress(bytes done)``) and checks ``stop`` (a ``threading.Event``);
when it is set it removes the file and raises ``AllocationStopped``, so a
signal handler can abandon a minutes-long allocation at once (run the
constructor on a thread). ``close`` unmaps and unlinks. The CUDA backend
registers ``view`` with the driver as pinned.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

PIECE = 64 * 2**20
PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14+; the mmap module names it only from Python 3.13


class AllocationStopped(Exception):
    """The allocation was abandoned because ``stop`` was set; the file is gone."""

    def __init__(self, done: int, size: int):
        super().__init__(f"stopped after {done} of {size} bytes")
        self.done, self.size = done, size


class SharedArena:
    def __init__(self, shm_dir: Path, tag: str, size: int, stop: threading.Event | None = None,
                 on_progress: Callable[[int], None] | None = None):
        self.path = arena_path(Path(shm_dir), tag)
        self.size = size
        problem = room_problem(Path(shm_dir), size)
        if problem:
            raise RuntimeError(problem)
        start = time.monotonic()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            self._map = _allocate(fd, size, stop or threading.Event(), on_progress)
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            raise RuntimeError(f"cannot allocate the host tier in {shm_dir}: {exc.strerror}") from None
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.view = np.frombuffer(self._map, dtype=np.uint8)
        self.setup_seconds = time.monotonic() - start

    def close(self) -> None:
        self.view = None
        try:
            self._map.close()
        except BufferError:
            pass  # a copy thread still holds a view; the mapping goes with the process
        self.path.unlink(missing_ok=True)


def arena_path(shm_dir: Path, tag: str) -> Path:
    """Where this process's arena of instance ``tag`` lives (reclaim_stale globs the tag)."""
    return Path(shm_dir) / f"kvd-arena-{tag}-{os.getpid()}"


def _allocate(fd: int, size: int, stop: threading.Event, on_progress) -> mmap.mmap:
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    populate = _madvise_populate
    try:
        for off in range(0, size, PIECE):
            if stop.is_set():
                raise AllocationStopped(off, size)
            n = min(PIECE, size - off)
            os.posix_fallocate(fd, off, n)
            try:
                populate(m, off, n)
            except OSError as exc:
                if exc.errno != errno.EINVAL or populate is _touch:
                    raise
                populate = _touch  # kernel before 5.14
                populate(m, off, n)
            if on_progress is not None:
                on_progress(off + n)
    except BaseException:
        m.close()
        raise
    return m


def _madvise_populate(m: mmap.mmap, off: int, n: int) -> None:
    m.madvise(MADV_POPULATE_WRITE, off, n)


def _touch(m: mmap.mmap, off: int, n: int) -> None:
    m[off:off + n:PAGE] = bytes(len(range(off, off + n, PAGE)))  # the pages hold zeros already


def room_problem(shm_dir: Path, size: int) -> str | None:
    """Why a host tier of ``size`` bytes cannot go in ``shm_dir``, or None."""
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if size > free:
        return (f"a host tier of {size / 2**30:.2f} GiB does not fit: {shm_dir} has "
                f"{free / 2**30:.2f} GiB free (lower host_capacity or grow the tmpfs)")
    return None
