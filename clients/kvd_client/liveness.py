"""Is the daemon a client talks to still alive? Asked of the kernel, not the socket.

The daemon holds an exclusive flock on ``<runtime_dir>/kvd.lock`` (holding
its pid) for its whole life; the kernel drops the lock when the process
dies, whatever killed it. ``DaemonProbe.gone(pid)`` tries a shared lock
without blocking: taking it means no daemon runs; failing means one does,
and the pid written in the file tells whether it is still the one
(``pid``, from ``hello``) or a new one (a restart). A lock file that cannot
be opened for reading (another user's daemon without group access) answers
"alive": the client then relies on its timeouts alone. Three system calls:
cheap enough to ask every few tens of milliseconds while requests wait.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class DaemonProbe:
    def __init__(self, runtime_dir: Path):
        self.path = Path(runtime_dir) / "kvd.lock"

    def gone(self, pid: int | None) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # cannot tell: rely on timeouts
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
                return pid is not None and owner.isdigit() and int(owner) != pid
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        finally:
            os.close(fd)
