"""One chunk file the disk tier indexes: its key, namespace, geometry, path and readers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvd.tiers.disk.chunk_file import file_size


@dataclass(eq=False)
class DiskEntry:
    key: bytes
    ns: bytes
    length: int
    shards: int
    shard_bytes: int
    path: Path
    refs: int = 0

    @property
    def size(self) -> int:
        return file_size(self.length)
