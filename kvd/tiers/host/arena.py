"""The host arena: one shared-memory file per runtime dir, kept across daemon restarts.

``kvd-arena-<instance tag>`` under shm_dir (``arena_path``; the tag is the runtime dir's, so
the next daemon finds and adopts it). ``SharedArena(path, size)`` allocates and maps every
page up front, in pieces on threads (MADV_HUGEPAGE advised), so the request path never
page-faults and a full tmpfs is an error here, never a SIGBUS later; with ``adopt=True`` it
maps an existing file at once and populates it behind (``wait_populated``). Progress via
``on_progress``; ``stop`` set raises ``AllocationStopped`` (a new file removed first).
``close(keep)`` unmaps, removing the file unless ``keep``. ``stat`` identifies the file
(never a client's pool); ``huge_pages`` says what the kernel gave.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

PIECE = 64 * 2**20
PAGE = mmap.PAGESIZE
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+; named by mmap from Python 3.13
MADV_HUGEPAGE = 14
THREADS = max(1, min(8, os.cpu_count() or 1))


class AllocationStopped(Exception):
    """The allocation was abandoned because ``stop`` was set (a new file is gone)."""

    def __init__(self, done: int, size: int):
        super().__init__(f"stopped after {done} of {size} bytes")
        self.done, self.size = done, size


class SharedArena:
    def __init__(self, path: Path, size: int, stop: threading.Event | None = None,
                 on_progress: Callable[[int], None] | None = None, adopt: bool = False,
                 threads: int = THREADS):
        self.path = Path(path)
        self.size = size
        self.adopted = adopt
        self._closing = threading.Event()  # stops the mapping-in behind an adoption
        self._populating = None
        if not adopt:
            problem = room_problem(self.path.parent, size)
            if problem:
                raise RuntimeError(problem)
        start = time.monotonic()
        flags = os.O_RDWR | os.O_CLOEXEC | (0 if adopt else os.O_CREAT | os.O_EXCL)
        fd = os.open(self.path, flags, 0o600)
        try:
            if adopt and os.fstat(fd).st_size != size:
                raise RuntimeError(f"{self.path} is not {size} bytes long")
            self._map = _map_in(fd, size, not adopt, stop or threading.Event(), on_progress,
                                threads)
            self.stat = os.fstat(fd)  # the file's identity, whatever happens to its name
        except OSError as exc:
            self._abandon()
            what = "map" if adopt else "allocate"
            raise RuntimeError(f"cannot {what} the host tier in {self.path.parent}: "
                               f"{exc.strerror}") from None
        except BaseException:
            self._abandon()
            raise
        finally:
            os.close(fd)
        self.view = np.frombuffer(self._map, dtype=np.uint8)
        self.setup_seconds = time.monotonic() - start
        if adopt:  # the pages exist: serve now, map them in behind (a fault meanwhile is minor)
            self.populated_seconds = None
            self._populating = threading.Thread(target=self._populate_behind, args=(threads,),
                                                name="kvd-populate", daemon=True)
            self._populating.start()

    def _populate_behind(self, threads: int) -> None:
        t0 = time.monotonic()
        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="kvd-populate") as pool:
                _populate(self._map, -1, self.size, False, self._closing, None, pool, threads)
        except (AllocationStopped, OSError, ValueError):
            return  # stopped (or closed) first: the faults map what is used
        self.populated_seconds = time.monotonic() - t0

    def _abandon(self) -> None:
        if not self.adopted:
            self.path.unlink(missing_ok=True)

    @property
    def huge_pages(self) -> int:
        """Bytes of the mapping the kernel maps with 2 MiB pages (0 where it reports none)."""
        return huge_mapped(self.view.ctypes.data if self.view is not None else 0)

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Wait for an adopted arena's pages to be mapped in (True when they are)."""
        if self._populating is not None:
            self._populating.join(timeout)
            return not self._populating.is_alive()
        return True

    def close(self, keep: bool = False) -> None:
        self._closing.set()
        self.wait_populated()
        self.view = None
        try:
            self._map.close()
        except BufferError:
            pass  # a copy thread still holds a view; the mapping goes with the process
        if not keep:
            self.path.unlink(missing_ok=True)


def arena_path(shm_dir: Path, tag: str) -> Path:
    """Where the arena of the runtime dir of instance ``tag`` lives."""
    return Path(shm_dir) / f"kvd-arena-{tag}"


def _map_in(fd: int, size: int, allocate: bool, stop: threading.Event, on_progress,
            threads: int) -> mmap.mmap:
    """The mapping; a new arena's pages allocated and mapped in (an adopted one's are
    mapped in behind, by ``SharedArena``)."""
    if allocate:
        os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    try:
        try:
            m.madvise(MADV_HUGEPAGE)
        except OSError:
            pass  # not built with transparent huge pages: small pages it is
        if allocate:
            with ThreadPoolExecutor(threads, thread_name_prefix="kvd-populate") as pool:
                _populate(m, fd, size, allocate, stop, on_progress, pool, threads)
    except BaseException:
        m.close()
        raise
    return m


def _populate(m, fd, size, allocate, stop, on_progress, pool, threads) -> None:
    """Populate ``threads`` pieces at once; progress counts populated bytes."""
    pending, done = [], 0
    state = {"old_kernel": False,  # set once MADV_POPULATE_* is refused (kernel < 5.14)
             "fallocate": allocate and not huge_on_advice(Path(f"/proc/self/fd/{fd}"))}
    try:
        for off in range(0, size, PIECE):
            if stop.is_set():
                raise AllocationStopped(done, size)
            pending.append(pool.submit(_populate_piece, m, fd, off, min(PIECE, size - off),
                                       allocate, state))
            while len(pending) >= threads:
                done += pending.pop(0).result()
                if on_progress is not None:
                    on_progress(done)
        for fut in pending:
            done += fut.result()
            if on_progress is not None:
                on_progress(done)
        pending = []
    finally:
        for fut in pending:  # a piece failed or a stop came: let the others end first
            fut.cancel()
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the first failure is the one raised
                pass


def _populate_piece(m: mmap.mmap, fd: int, off: int, n: int, allocate: bool, state: dict) -> int:
    """Map in one piece: a new arena's pages are allocated and zeroed by the faults
    (MADV_POPULATE_WRITE; a full tmpfs is an error here, never a SIGBUS later), an
    adopted one's only mapped (MADV_POPULATE_READ: the mapping is writable, tmpfs has no
    dirty tracking, and it measured two to three times faster than WRITE on existing
    pages). Before Linux 5.14: a read per page (adopted), or posix_fallocate and a write
    per page (new)."""
    if state["fallocate"]:
        os.posix_fallocate(fd, off, n)
    if not state["old_kernel"]:
        try:
            m.madvise(MADV_POPULATE_WRITE if allocate else MADV_POPULATE_READ, off, n)
            return n
        except OSError as exc:
            if exc.errno in (errno.EFAULT, errno.ENOMEM):
                raise OSError(errno.ENOSPC, "out of room (tmpfs full, or memory short) while "
                              "populating it") from None
            if exc.errno != errno.EINVAL:
                raise
            state["old_kernel"] = True
    if not allocate:  # read faults only: requests may be writing these pages already
        _ = m[off:off + n:PAGE]
        return n
    if not state["fallocate"]:
        os.posix_fallocate(fd, off, n)  # a full tmpfs fails here rather than SIGBUS later
    m[off:off + n:PAGE] = bytes(len(range(off, off + n, PAGE)))  # a write per page (zeros)
    return n


def huge_on_advice(path: Path) -> bool:
    """Whether the tmpfs holding ``path`` gives huge pages only to mappings that ask
    (``huge=advise``): posix_fallocate would give it small pages before the faults ask."""
    try:
        target = os.path.realpath(path)
        best, options = "", ""
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                point = fields[1].encode().decode("unicode_escape")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) > len(best):
                    best, options = point, fields[3]
    except OSError:
        return False
    return "huge=advise" in options.split(",")


def huge_mapped(address: int) -> int:
    """``ShmemPmdMapped`` bytes of this process's mapping that starts at ``address``."""
    if not address:
        return 0
    start = f"{address:x}-"
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                if "-" in line.split(" ", 1)[0]:
                    inside = line.startswith(start)
                elif inside and line.startswith("ShmemPmdMapped:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def room_problem(shm_dir: Path, size: int, reusable: int = 0) -> str | None:
    """Why a host tier of ``size`` bytes cannot go in ``shm_dir``, or None; ``reusable``:
    bytes there that a new arena would replace (an arena that will not be adopted)."""
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize + reusable
    if size > free:
        return (f"a host tier of {size / 2**30:.2f} GiB does not fit: {shm_dir} has "
                f"{free / 2**30:.2f} GiB free (lower host_capacity or grow the tmpfs)")
    return None
