"""The host tier a stopped daemon keeps in shm_dir for the next start (warm restart).

Its files are ``kvd-arena-<tag>`` and ``kvd-arena-<tag>.index`` (the tag
names the runtime dir; kvd.tiers.host.arena_index.kept_files), and they hold
``host_capacity`` of memory until the next daemon of that runtime dir
adopts them. ``kept_bytes`` is that memory (the start-up room check counts
it as room: the tier is adopted or replaced). ``drop`` deletes them, and the
arenas named by pid that releases before warm restart left, under the
runtime dir's lock (``InstanceBusy`` while a daemon serves it, so none
adopts a tier while it goes); ``drop_command`` is the ``kvd drop-tier``
line that does it, for the daemon's shutdown line.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvd.server.runtime_dir import InstanceLock
from kvd.tiers.host.arena_index import kept_files
from kvd_protocol.runtime import instance_tag


def kept_bytes(shm_dir: Path, runtime_dir: Path) -> int:
    """Bytes of memory the tier kept for ``runtime_dir`` holds in ``shm_dir`` (0: none)."""
    total = 0
    for path in kept_files(shm_dir, instance_tag(runtime_dir)):
        try:
            total += os.stat(path).st_blocks * 512
        except OSError:
            pass
    return total


def drop(shm_dir: Path, runtime_dir: Path) -> tuple[int, list[Path]]:
    """Delete the tier kept for ``runtime_dir``: (bytes of memory freed, paths deleted)."""
    lock = InstanceLock(runtime_dir)
    if runtime_dir.is_dir():  # else no daemon serves it, nor can one start meanwhile here
        lock.acquire()
    try:
        tag = instance_tag(runtime_dir)
        freed, removed = 0, []
        for path in [*kept_files(shm_dir, tag), *sorted(shm_dir.glob(f"kvd-arena-{tag}-*"))]:
            try:
                blocks = os.stat(path).st_blocks * 512
                path.unlink()
            except FileNotFoundError:
                continue
            freed += blocks
            removed.append(path)
        return freed, removed
    finally:
        lock.release()


def drop_command(shm_dir: Path, runtime_dir: Path) -> str:
    """The command that frees the tier of ``runtime_dir`` once its daemon has stopped."""
    shm = "" if Path(shm_dir) == Path("/dev/shm") else f" --shm-dir {shm_dir}"
    return f"kvd drop-tier --runtime-dir {runtime_dir}{shm}"
