"""The host arena: one shared-memory file per daemon instance.

Named ``kvd-arena-<instance tag>-<pid>`` under the shm directory, so a new
daemon of the same runtime dir can find and reclaim it after a crash. The
file is fully allocated up front (posix_fallocate: a full /dev/shm fails
here with a clear message rather than SIGBUS later) and mapped with
MAP_POPULATE so the request path never page-faults. ``close`` unmaps and
unlinks. The CUDA backend registers ``view`` with the driver as pinned.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np


class SharedArena:
    def __init__(self, shm_dir: Path, tag: str, size: int):
        self.path = Path(shm_dir) / f"kvd-arena-{tag}-{os.getpid()}"
        self.size = size
        free = _free_bytes(shm_dir)
        if size > free:
            raise RuntimeError(f"host tier of {size} bytes does not fit: {shm_dir} has {free} "
                               "bytes free (lower host_capacity or grow the tmpfs)")
        start = time.monotonic()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, size, flags=flags)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise RuntimeError(f"cannot allocate the host tier in {shm_dir}: {exc.strerror}") from None
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


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
