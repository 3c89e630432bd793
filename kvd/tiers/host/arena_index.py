"""The host tier's index file: what a new daemon needs to adopt the arena after a restart.

``kvd-arena-<tag>.index`` beside the arena: a header (format, alignment, chunk_tokens,
capacity, the arena file's identity, ``RUNNING``/``CLEAN`` state, owner pid and start time)
and fixed-size records, one per committed shard (``RECORD_DTYPE``: state, ``SEALED``/
``ON_DISK`` flags, key, namespace, offset, sizes, digest, last use, hits). A separate table,
because records found in the arena could be forged by an engine's KV bytes. Crash
consistency: a record's body is written before its state word turns ``LIVE`` (one aligned
store), only after the shard's bytes landed, and freed before the slot is reused; digests
before ``SEALED``. Records are written on the event loop only; the table grows by doubling
(``grow`` is False on a full tmpfs, never a SIGBUS).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

import numpy as np

from kvd.tiers.host.arena import arena_path

MAGIC = b"kvd-host"
VERSION = 1
HEADER = 4096
LIVE = 0x4C495645      # "LIVE"; a record whose state word is anything else is free
RUNNING, CLEAN = 1, 2
SEALED, ON_DISK = 1, 2
FIRST_RECORDS = 4096

_HEAD = struct.Struct("@8sIIIIQQQIIQddQ")
_BODY = struct.Struct("@IHBB16s16sQQQQII")
_STATE = struct.Struct("@I")
_FLAGS = struct.Struct("@H")
_DIGEST = struct.Struct("@Q")
RECORD = _BODY.size
RECORD_DTYPE = np.dtype({"names": ["state", "flags", "rank", "shards", "key", "ns", "offset",
                                   "shard_bytes", "digest", "used", "hits"],
                         "formats": ["=u4", "=u2", "u1", "u1", "V16", "V16", "=u8", "=u8", "=u8",
                                     "=u8", "=u4"],
                         "offsets": [0, 4, 6, 7, 8, 24, 40, 48, 56, 64, 72],
                         "itemsize": RECORD})


class IndexProblem(Exception):
    """The index cannot be adopted; the message says why, in words for the log."""


def index_path(arena: Path) -> Path:
    return arena.with_name(arena.name + ".index")


def kept_files(shm_dir: Path, tag: str) -> list[Path]:
    """The host tier the daemons of instance ``tag`` keep in ``shm_dir`` across restarts:
    the arena and its index (present or not)."""
    arena = arena_path(shm_dir, tag)
    return [arena, index_path(arena)]


class ArenaIndex:
    """An open index file (``create`` or ``open``); every method runs on the event loop."""

    def __init__(self, path: Path, fd: int, m: mmap.mmap, head: dict):
        self.path, self._fd, self._map, self.head = path, fd, m, head
        self.records = (len(m) - HEADER) // RECORD

    # ---- opening ----------------------------------------------------------------------

    @classmethod
    def create(cls, path: Path, arena_stat: os.stat_result, capacity: int, align: int,
               chunk_tokens: int) -> "ArenaIndex":
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        size = HEADER + FIRST_RECORDS * RECORD
        try:
            os.posix_fallocate(fd, 0, size)
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        head = {"version": VERSION, "record": RECORD, "align": align, "chunk_tokens": chunk_tokens,
                "capacity": capacity, "dev": arena_stat.st_dev, "ino": arena_stat.st_ino,
                "state": RUNNING, "pid": 0, "start": 0, "created": time.time(), "stopped": 0.0,
                "adoptions": 0}
        index = cls(path, fd, m, head)
        index.claim()
        return index

    @classmethod
    def open(cls, path: Path) -> "ArenaIndex":
        """Map an existing index; ``IndexProblem`` when it is not one of ours."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise IndexProblem(f"cannot open {path.name}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER + RECORD or (size - HEADER) % RECORD:
                raise IndexProblem(f"{path.name} has a size ({size} bytes) no index has")
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        fields = _HEAD.unpack_from(m, 0)
        if fields[0] != MAGIC:
            m.close()
            os.close(fd)
            raise IndexProblem(f"{path.name} is not a kvd host tier index")
        names = ("version", "record", "align", "chunk_tokens", "capacity", "dev", "ino", "state",
                 "pid", "start", "created", "stopped", "adoptions")
        return cls(path, fd, m, dict(zip(names, fields[1:])))

    def problem(self, arena_stat: os.stat_result, capacity: int, align: int,
                chunk_tokens: int) -> str | None:
        """Why this index cannot describe ``arena_stat`` for a daemon of these settings."""
        h = self.head
        if h["version"] != VERSION or h["record"] != RECORD:
            return f"index format {h['version']} (this daemon writes format {VERSION})"
        if (h["dev"], h["ino"]) != (arena_stat.st_dev, arena_stat.st_ino):
            return "the index belongs to another arena file"
        if h["capacity"] != capacity or arena_stat.st_size != capacity:
            return (f"made for host_capacity {h['capacity']} bytes (file of {arena_stat.st_size}), "
                    f"this daemon has {capacity}")
        if h["align"] != align:
            return (f"made with slot alignment {h['align']}, this daemon uses {align}: "
                    "disk_dir was set or unset")
        if h["chunk_tokens"] != chunk_tokens:
            return f"made for chunk_tokens {h['chunk_tokens']}, this daemon has {chunk_tokens}"
        if h["state"] not in (RUNNING, CLEAN):
            return f"its state word is {h['state']:#x}"
        return None

    def claim(self) -> None:
        """Mark the index owned by this process and not cleanly stopped."""
        h = self.head
        h["state"], h["pid"], h["start"] = RUNNING, os.getpid(), process_start(os.getpid())
        self._write_head()

    def adopted(self) -> None:
        self.head["adoptions"] += 1
        self.claim()

    def _write_head(self) -> None:
        h = self.head
        _HEAD.pack_into(self._map, 0, MAGIC, h["version"], h["record"], h["align"],
                        h["chunk_tokens"], h["capacity"], h["dev"], h["ino"], h["state"], h["pid"],
                        h["start"], h["created"], h["stopped"], h["adoptions"])

    # ---- records ----------------------------------------------------------------------

    def live_records(self) -> tuple[np.ndarray, np.ndarray]:
        """(record numbers, records) of every ``LIVE`` record, copied out of the mapping."""
        table = np.frombuffer(self._map[HEADER:HEADER + self.records * RECORD], RECORD_DTYPE)
        numbers = np.flatnonzero(table["state"] == LIVE)
        return numbers, table[numbers]

    def grow(self) -> bool:
        """Double the table; False when shm_dir has no room for it."""
        old, new = len(self._map), HEADER + 2 * self.records * RECORD
        try:
            os.posix_fallocate(self._fd, old, new - old)
        except OSError:
            os.ftruncate(self._fd, old)
            return False
        self._map.resize(new)
        self.records = (new - HEADER) // RECORD
        return True

    def write(self, n: int, flags: int, rank: int, shards: int, key: bytes, ns: bytes, offset: int,
              shard_bytes: int, digest: int, used: int, hits: int) -> None:
        at = HEADER + n * RECORD
        _BODY.pack_into(self._map, at, 0, flags, rank, shards, key, ns, offset, shard_bytes,
                        digest, used, hits, 0)
        _STATE.pack_into(self._map, at, LIVE)

    def set_state(self, n: int, live: bool) -> None:
        _STATE.pack_into(self._map, HEADER + n * RECORD, LIVE if live else 0)

    def seal(self, n: int, digest: int, flags: int) -> None:
        """Write the digest, then ``flags`` (with ``SEALED``: after the digest)."""
        at = HEADER + n * RECORD
        _DIGEST.pack_into(self._map, at + 56, digest)
        _FLAGS.pack_into(self._map, at + 4, flags | SEALED)

    def sealed_digest(self, n: int) -> int | None:
        """Record ``n``'s digest, or None while it is not ``SEALED``."""
        at = HEADER + n * RECORD
        if not _FLAGS.unpack_from(self._map, at + 4)[0] & SEALED:
            return None
        return _DIGEST.unpack_from(self._map, at + 56)[0]

    def set_flag(self, n: int, flag: int, on: bool) -> None:
        at = HEADER + n * RECORD + 4
        flags = _FLAGS.unpack_from(self._map, at)[0]
        _FLAGS.pack_into(self._map, at, flags | flag if on else flags & ~flag)

    def checkpoint(self, numbers, used, hits) -> None:
        """Write the last-use clock and hits of records ``numbers`` (arrays) in bulk."""
        table = np.frombuffer(self._map, RECORD_DTYPE, count=self.records, offset=HEADER)
        table["used"][numbers] = used
        table["hits"][numbers] = hits
        del table  # the mapping cannot be resized or closed while a view of it lives

    # ---- closing ----------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._map is not None

    def close(self, clean: bool) -> None:
        """Unmap; with ``clean`` the next daemon trusts every record without verifying."""
        if self._map is None:
            return
        if clean:
            self.head["state"], self.head["stopped"] = CLEAN, time.time()
            self._write_head()
        self._map.close()
        os.close(self._fd)
        self._map = None


def process_start(pid: int) -> int:
    """The start time of process ``pid`` (clock ticks since boot), 0 when it is gone: with
    the pid it names one process, whatever pids are reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2:].split()[19])


def process_state(pid: int, start: int) -> str | None:
    """The state letter of process ``pid`` if it is the one started at ``start``, else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] if int(fields[19]) == start else None
