"""Disk tier: the index of chunk files, its LRU, its IO threads and recovery.

State lives on the event loop; file IO runs on ``threads`` workers, never blocking the loop.
Promises: used bytes plus writes in flight never exceed ``capacity`` (LRU files nobody reads
are deleted first); ``submit_write`` never blocks (None and a counted drop when the queue is
full, the key is there, or no room); one key leaves exactly one final file; ``read_into``
returns True with verified bytes or False (bad file deleted, all counted), never raises for
IO, never gives wrong bytes (``read_many``: another reader, e.g. GDS, under the same rules).
Recovery (``start``) scans the directory in the background with progress lines; keys
written since start win. One daemon per directory (flock; a second gets ``EBUSY``).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvd.tiers.disk.chunk_file import ChunkCorrupt, ChunkFiles, file_size
from kvd.tiers.disk.entry import DiskEntry
from kvd.tiers.disk.recovery import DiskRecovery
from kvd.tiers.disk.scan import unlink as _unlink

log = logging.getLogger("kvd")


class _Busy:
    """Wall seconds with at least one operation of a kind in flight (for GB/s)."""

    def __init__(self):
        self.inflight, self.since, self.seconds = 0, 0.0, 0.0

    def begin(self) -> None:
        if self.inflight == 0:
            self.since = time.monotonic()
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.seconds += time.monotonic() - self.since


class DiskTier(DiskRecovery):
    def __init__(self, root, capacity: int, threads: int = 4, queue_chunks: int = 256,
                 direct: bool | None = None, files: ChunkFiles | None = None):
        self.files = ChunkFiles(Path(root), direct) if files is None else files
        self.root = self.files.root
        self._lock = _lock_dir(self.root)
        self.capacity = capacity
        self.queue_chunks = queue_chunks
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="kvd-disk")
        self.entries: OrderedDict[bytes, DiskEntry] = OrderedDict()
        self.used = 0
        self.reserved = 0
        self.writing: dict[bytes, asyncio.Future] = {}
        self.deleting: dict[bytes, asyncio.Future] = {}
        self.counters: Counter = Counter()
        self.recovery = {"state": "idle", "files_scanned": 0, "files_total": 0, "chunks": 0,
                         "bytes": 0, "removed": 0, "temp_removed": 0, "over_capacity": 0,
                         "seconds": 0.0}
        self.on_evict = None  # callable(key) when a file leaves the index
        self.on_progress = None  # callable(text) with each recovery progress line
        self._reads, self._writes = _Busy(), _Busy()
        self._scan = None
        self._closed = False

    # ---- lookup side -------------------------------------------------------------

    def get(self, key: bytes, touch: bool = True) -> DiskEntry | None:
        entry = self.entries.get(key)
        if entry is not None and touch:
            self.entries.move_to_end(key)
        return entry

    async def _io(self, fn, *args):
        """Run ``fn`` on an IO thread. A cancelled caller still waits for the thread to
        finish, so no thread ever touches a buffer its owner already gave back."""
        fut = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.gather(fut, return_exceptions=True)
            raise

    async def read_into(self, entry: DiskEntry, dest) -> bool:
        return await self.read_many([entry], lambda es: [_attempt(
            self.files.read_into, es[0].path, es[0].ns, es[0].key, dest)]) == 1

    async def read_many(self, entries: list, read) -> int:
        """Run ``read(entries)`` on an IO thread; it returns, per entry, None or the
        exception its read raised. Failures are handled and counted (a corrupt file is
        deleted); returns how many entries, in order, were read fine."""
        for e in entries:
            e.refs += 1
        self._reads.begin()
        try:
            results = await self._io(read, entries)
        except Exception as exc:  # noqa: BLE001 - the reader itself failed: the first one fails
            results = [exc]
        finally:
            for e in entries:
                e.refs -= 1
            self._reads.end()
        n = 0
        for e, result in zip(entries, results):
            if result is not None:
                self._failed(e, result)
                break
            n += 1
            self.counters["reads"] += 1
            self.counters["read_bytes"] += e.length
        return n

    def _failed(self, entry: DiskEntry, exc: BaseException) -> None:
        if isinstance(exc, ChunkCorrupt):
            log.warning("disk chunk %s is corrupt (%s): deleted", entry.path.name, exc)
            self.counters["checksum_failures"] += 1
            self._forget(entry, delete=True)
        elif isinstance(exc, FileNotFoundError):
            log.warning("disk chunk %s vanished", entry.path.name)
            self.counters["vanished"] += 1
            self._forget(entry, delete=False)
        else:
            log.warning("disk read of %s failed: %s", entry.path.name, exc)
            self.counters["read_errors"] += 1

    # ---- write side ----------------------------------------------------------------

    def submit_write(self, ns: bytes, key: bytes, payload, shards: int,
                     shard_bytes: int) -> asyncio.Future | None:
        """Queue a write of ``payload`` (must stay valid until the future is done)."""
        if self._closed or key in self.entries or key in self.writing:
            return None
        if len(self.writing) >= self.queue_chunks:
            self.counters["demotions_dropped"] += 1
            return None
        size = file_size(memoryview(payload).nbytes)
        if not self._make_room(size):
            self.counters["demotions_dropped"] += 1
            return None
        self.reserved += size
        fut = asyncio.ensure_future(self._write(ns, key, payload, shards, shard_bytes, size))
        self.writing[key] = fut
        return fut

    async def _write(self, ns, key, payload, shards, shard_bytes, size) -> bool:
        try:
            pending = self.deleting.get(key)
            if pending is not None:
                await asyncio.shield(pending)
            self._writes.begin()
            try:
                path = await self._io(self.files.write, ns, key, payload, shards, shard_bytes)
            finally:
                self._writes.end()
        except OSError as exc:
            kind = "enospc" if exc.errno == errno.ENOSPC else "write_errors"
            self.counters[kind] += 1
            self.counters["demotions_failed"] += 1
            log.warning("disk write of %s failed: %s", key.hex(), exc)
            return False
        finally:
            self.reserved -= size
            self.writing.pop(key, None)
        entry = DiskEntry(key, ns, _payload_len(payload), shards, shard_bytes, path)
        self.entries[key] = entry
        self.used += entry.size
        self.counters["writes"] += 1
        self.counters["write_bytes"] += entry.length
        return True

    def _make_room(self, size: int) -> bool:
        if size > self.capacity:
            return False
        while self.used + self.reserved + size > self.capacity:
            victim = next((e for e in self.entries.values() if e.refs == 0), None)
            if victim is None:
                return False
            self.evict(victim.key)
        return True

    def evict(self, key: bytes) -> bool:
        """Delete ``key``'s file unless it is gone or being read (then False)."""
        entry = self.entries.get(key)
        if entry is None or entry.refs:
            return False
        self.counters["evictions"] += 1
        self._forget(entry, delete=True)
        return True

    def _forget(self, entry: DiskEntry, delete: bool) -> None:
        """Drop ``entry`` from the index (its file deleted on an IO thread when ``delete``)."""
        if self.entries.get(entry.key) is not entry:
            return
        del self.entries[entry.key]
        self.used -= entry.size
        if self.on_evict is not None:
            self.on_evict(entry.key)
        if delete:
            fut = asyncio.get_running_loop().run_in_executor(self.pool, _unlink, entry.path)
            self.deleting[entry.key] = fut
            fut.add_done_callback(lambda f, k=entry.key: self._deleted(k, f))

    def _deleted(self, key: bytes, fut) -> None:
        if self.deleting.get(key) is fut:
            del self.deleting[key]

    async def flush(self) -> int:
        """Wait until no write is queued or in flight; returns writes waited for."""
        waited = 0
        while self.writing or self.deleting:
            pending = list(self.writing.values()) + list(self.deleting.values())
            waited += len(self.writing)
            await asyncio.gather(*pending, return_exceptions=True)
        return waited

    async def clear(self) -> tuple[int, int]:
        """Delete every file nobody is reading: (deleted, kept because in use)."""
        await self.flush()
        victims = [e for e in self.entries.values() if e.refs == 0]
        for e in victims:
            self._forget(e, delete=True)
        await self.flush()
        return len(victims), len(self.entries)

    async def close(self) -> None:
        self._closed = True
        if self._scan is not None:
            self._scan.cancel()
            await asyncio.gather(self._scan, return_exceptions=True)
        await self.flush()
        self.pool.shutdown(wait=True)
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    # ---- stats -------------------------------------------------------------------------

    def stats(self) -> dict:
        c = self.counters
        return {"capacity_bytes": self.capacity, "used_bytes": self.used,
                "chunks": len(self.entries), "evictions": c["evictions"],
                "dir": str(self.root), "io_mode": "direct" if self.files.direct else "buffered",
                "queued_writes": len(self.writing), "writes": c["writes"],
                "write_bytes": c["write_bytes"], "write_gbps": _gbps(c["write_bytes"], self._writes),
                "reads": c["reads"], "read_bytes": c["read_bytes"],
                "read_gbps": _gbps(c["read_bytes"], self._reads),
                "demotions_dropped": c["demotions_dropped"],
                "demotions_failed": c["demotions_failed"], "enospc": c["enospc"],
                "write_errors": c["write_errors"], "read_errors": c["read_errors"],
                "checksum_failures": c["checksum_failures"], "vanished": c["vanished"],
                "io_errors": c["enospc"] + c["write_errors"] + c["read_errors"] + c["vanished"],
                "recovery": dict(self.recovery)}


def _lock_dir(root: Path) -> int:
    """Hold an exclusive flock on ``<root>/.kvd-disk.lock``: one daemon per disk_dir."""
    fd = os.open(root / ".kvd-disk.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(errno.EBUSY, "another kvd daemon uses this disk_dir") from None
    return fd


def _attempt(fn, *args) -> BaseException | None:
    """None when ``fn(*args)`` returns, else the exception it raised."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - handed back to the loop to count
        return exc
    return None


def _payload_len(payload) -> int:
    return memoryview(payload).nbytes


def _gbps(nbytes: int, busy: _Busy) -> float:
    secs = busy.seconds + (time.monotonic() - busy.since if busy.inflight else 0.0)
    return round(nbytes / secs / 1e9, 3) if secs > 0 else 0.0
