"""The host tier files a test's daemons leave in /dev/shm (a helper module, not a
conftest: ``from conftest import`` is ambiguous once tests/cuda has its own)."""

from __future__ import annotations

from pathlib import Path

from kvd_protocol.runtime import instance_tag

SHM = Path("/dev/shm")


def arena_files(runtime_dir: Path) -> list[Path]:
    """The host tier files of the daemons of ``runtime_dir``: ``kvd-arena-<tag>`` and its
    ``.index`` (kept across restarts)."""
    return sorted(SHM.glob(f"kvd-arena-{instance_tag(runtime_dir)}*"))
