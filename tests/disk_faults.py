"""Test doubles that inject disk faults; the daemon's code never looks for faults itself.

``FaultyChunkFiles`` is a ``ChunkFiles`` whose IO calls (``write_parts``,
``read_parts``: every payload byte goes through them) fail or stall as asked:

- ``enospc``: every write fails with ENOSPC once its temp file exists;
- ``eio_read``: every read fails with EIO;
- ``slow_read``: every read first sleeps ``SLOW_READ_S``;
- ``slow_write``: every write first sleeps ``SLOW_WRITE_S``.

``EioKvikio`` stands in for the ``kvikio`` module given to the GPU Direct
Storage loader: every ``CuFile`` open fails with EIO (fault ``gds_eio``).
Fault ``rebuild_bug`` stands for a bug of ours in adopting a host tier:
the rebuild from its index raises (kvd.server.host_tier must start empty).
``install(faults)`` makes a process's daemon use them: the disk tier it
builds gets a ``FaultyChunkFiles``, ``open_gds`` an ``EioKvikio``
(tests/fault_daemon.py calls it before running ``kvd serve``).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from kvd.tiers.disk.chunk_file import ChunkFiles

FAULTS = ("enospc", "eio_read", "slow_read", "slow_write", "gds_eio", "rebuild_bug")
SLOW_READ_S = 2.5
SLOW_WRITE_S = 0.75


class FaultyChunkFiles(ChunkFiles):
    def __init__(self, root, faults, direct: bool | None = None):
        super().__init__(root, direct)
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULTS}")
        self.faults = set(faults)

    def write_parts(self, fd: int, parts: list) -> int:
        if "enospc" in self.faults:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if "slow_write" in self.faults:
            time.sleep(SLOW_WRITE_S)
        return super().write_parts(fd, parts)

    def read_parts(self, fd: int, parts: list) -> int:
        if "eio_read" in self.faults:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if "slow_read" in self.faults:
            time.sleep(SLOW_READ_S)
        return super().read_parts(fd, parts)


class EioKvikio:
    """The ``kvikio`` module, but every file open for a read fails with EIO."""

    def __init__(self, kvikio):
        self._kvikio = kvikio

    def __getattr__(self, name):
        return getattr(self._kvikio, name)

    def CuFile(self, path, mode="r"):  # noqa: N802 - kvikio's name
        raise OSError(errno.EIO, "injected GPU Direct Storage read error", str(path))


def install(faults) -> None:
    """Make this process's daemon build its disk tier and GDS loader from the doubles."""
    import kvd.cuda.gds as gds
    import kvd.tiers.disk.tier as disk

    faults = set(faults)
    files_faults = faults - {"gds_eio", "rebuild_bug"}
    if "rebuild_bug" in faults:
        import kvd.server.host_tier as host_tier

        def rebuild(*args, **kwargs):
            raise ValueError("a bug, injected by tests/disk_faults.py")
        host_tier.rebuild = rebuild
    real_tier, real_open_gds = disk.DiskTier, gds.open_gds

    class FaultyDiskTier(real_tier):
        def __init__(self, root, *args, **kwargs):
            super().__init__(root, *args, files=FaultyChunkFiles(Path(root), files_faults),
                             **kwargs)

    def open_gds(threads: int):
        kvikio, mode = real_open_gds(threads)
        return (EioKvikio(kvikio) if kvikio is not None and "gds_eio" in faults else kvikio), mode

    disk.DiskTier = FaultyDiskTier  # kvd.server.daemon imports both when it builds the tiers
    gds.open_gds = open_gds
