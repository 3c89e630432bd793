"""Host buffers for the probes in tools/probes/, registered with the driver as kvd's arena is.

- ``registered(nbytes, kind)``: ``shm`` (a /dev/shm file, as the arena), ``thp`` or
  ``small`` (anonymous memory advised into 2 MiB or 4 KiB pages), registered portable +
  device-mapped in kvd's pieces; kept for the life of the process.
- ``anon_huge_kib()``: this process's anonymous memory in huge pages, to see whether
  the kernel gave any.
"""

from __future__ import annotations

import numpy as np


def registered(nbytes: int, kind: str = "shm") -> np.ndarray:
    """A host buffer registered with the driver as kvd's arena is (``cuMemHostRegister``
    portable + device-mapped in its pieces). ``shm``: a /dev/shm file as the arena
    (unlinked at once; 4 KiB pages unless the tmpfs gives huge ones). ``thp`` / ``small``:
    anonymous memory advised MADV_HUGEPAGE / MADV_NOHUGEPAGE, 2 MiB aligned: do huge host
    pages change what the copy engines pay per row? Mapping and registration live as long
    as the process (kept in ``_KEEP``: a mapping freed while registered would collide with
    the next)."""
    import mmap
    import os

    from kvd.cuda.devices import REGISTER_PIECE
    from kvd_protocol import cuda_driver
    huge = 2 << 20
    size = -(-nbytes // huge) * huge
    if kind == "shm":
        name = f"/dev/shm/dma-probe-{os.getpid()}-{nbytes}"
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.unlink(name)
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        buf = np.frombuffer(m, np.uint8)
    else:
        m = mmap.mmap(-1, size + huge)
        m.madvise(mmap.MADV_HUGEPAGE if kind == "thp" else mmap.MADV_NOHUGEPAGE)
        whole = np.frombuffer(m, np.uint8)
        at = -whole.ctypes.data % huge
        buf = whole[at:at + size]
    buf[::4096] = 0  # touch every page before registering
    for at in range(0, size, REGISTER_PIECE):
        cuda_driver.register_host(buf.ctypes.data + at, min(REGISTER_PIECE, size - at), 0)
    _KEEP.append((m, buf))
    return buf[:nbytes]


def anon_huge_kib() -> int:
    """This process's anonymous memory in huge pages (kB), from /proc/self/smaps_rollup."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")), 0)
    except OSError:
        return -1


_KEEP: list = []
