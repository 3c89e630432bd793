"""The host tier files a test's daemons leave in /dev/shm (a helper module, not a
conftest: ``from conftest import`` is ambiguous once tests/cuda has its own)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvd.tiers.host.arena_index import HEADER, LIVE, RECORD_DTYPE
from kvd_protocol.runtime import instance_tag

SHM = Path("/dev/shm")


def arena_files(runtime_dir: Path) -> list[Path]:
    """The host tier files of the daemons of ``runtime_dir``: ``kvd-arena-<tag>`` and its
    ``.index`` (kept across restarts)."""
    return sorted(SHM.glob(f"kvd-arena-{instance_tag(runtime_dir)}*"))


def flip_chunk(runtime_dir, n: int) -> None:
    """Flip a byte of the ``n``-th shard stored (the index's records by their use clock)."""
    files = arena_files(runtime_dir)
    (index,) = [p for p in files if p.suffix == ".index"]
    (arena,) = [p for p in files if p.suffix != ".index"]
    table = np.frombuffer(index.read_bytes()[HEADER:], RECORD_DTYPE)
    live = np.sort(table[table["state"] == LIVE], order="used")
    at = int(live["offset"][n] + live["shard_bytes"][n] // 3)
    with open(arena, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))
