"""The disk tier's recovery at start-up: its directory scanned into the index, in the background.

``DiskRecovery`` is extended by ``DiskTier`` (kvd/tiers/disk/tier.py), whose state it fills;
the scan runs on the IO threads (kvd/tiers/disk/scan.py) in jobs of ``SCAN_BATCH`` files:
temp files of earlier processes and files with a wrong header, version or length are
removed (counted), the rest join the index as least recently used. ``recovery`` (in
``stats``) holds its state and ``files_scanned`` of ``files_total``; a progress line every
``PROGRESS_S`` (log and ``on_progress``), one summary at the end. Keys written since
start-up win over scanned files.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvd.tiers.disk.entry import DiskEntry
from kvd.tiers.disk.scan import count_entries
from kvd.tiers.disk.scan import names as _names
from kvd.tiers.disk.scan import ns_dirs as _ns_dirs
from kvd.tiers.disk.scan import scan_files as _scan_files
from kvd.tiers.disk.scan import unlink as _unlink
from kvd.tiers.progress import Progress

log = logging.getLogger("kvd")
PROGRESS_S = 2.0
SCAN_BATCH = 2048  # files per recovery job


class DiskRecovery:
    # ---- recovery ---------------------------------------------------------------------

    def start(self) -> None:
        log.info("disk tier: %.1f MiB at %s, IO %s, %d threads", self.capacity / 2**20, self.root,
                 self.files.mode, self.threads)
        self._scan = asyncio.ensure_future(self._recover())

    async def _recover(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        rec = self.recovery
        rec["state"] = "counting"
        try:
            dirs = await loop.run_in_executor(self.pool, _ns_dirs, self.root)
            rec["files_total"] = await loop.run_in_executor(self.pool, count_entries, dirs)
            rec["state"] = "scanning"
            self._progress(f"disk recovery: scanning {rec['files_total']} files in {len(dirs)} "
                           "directories")
            progress = Progress(rec["files_total"], "files", PROGRESS_S)
            for d in dirs:
                names = await loop.run_in_executor(self.pool, _names, d)
                batches = [names[j:j + SCAN_BATCH] for j in range(0, len(names), SCAN_BATCH)]
                for k in range(0, len(batches), self.threads):  # `threads` batches at once
                    jobs = batches[k:k + self.threads]
                    for found, removed, temps in await asyncio.gather(*(
                            loop.run_in_executor(self.pool, _scan_files, d, b,
                                                 self.files.temp_prefix) for b in jobs)):
                        rec["removed"] += removed
                        rec["temp_removed"] += temps
                        self._merge(found)
                    rec["files_scanned"] += sum(map(len, jobs))
                    # files written since the count: the total grows with them
                    rec["files_total"] = progress.total = max(rec["files_total"], rec["files_scanned"])
                    if progress.due():
                        text, _ = progress.report(rec["files_scanned"])
                        self._progress(f"disk recovery: {text}, {rec['chunks']} chunks so far")
        except asyncio.CancelledError:
            rec["state"] = "cancelled"
            raise
        except OSError as exc:
            rec["state"] = f"failed: {exc}"
            log.error("disk recovery failed: %s", exc)
            self._progress(None)
            return
        rec["state"] = "done"
        rec["seconds"] = round(time.monotonic() - t0, 3)
        log.info("disk recovery: %d chunks, %.1f MiB, %d bad files and %d temp files removed, "
                 "%.2f s", rec["chunks"], rec["bytes"] / 2**20, rec["removed"],
                 rec["temp_removed"], rec["seconds"])
        self._progress(None, f"disk recovery done: {rec['chunks']} chunks")

    def _progress(self, line: str | None, status: str | None = None) -> None:
        """Log ``line``; hand ``status or line`` to ``on_progress``."""
        if line:
            log.info("%s", line, extra={"recovery": dict(self.recovery)})
        if self.on_progress is not None:
            self.on_progress(status or line or f"disk recovery {self.recovery['state']}")

    def _merge(self, found: list) -> None:
        found.sort(key=lambda item: item[1], reverse=True)  # newest first: oldest ends LRU-first
        for head, _mtime, path in found:
            if head.key in self.entries or head.key in self.writing or head.key in self.deleting:
                continue
            entry = DiskEntry(head.key, head.ns, head.length, head.shards, head.shard_bytes, path)
            if self.used + self.reserved + entry.size > self.capacity:
                asyncio.get_running_loop().run_in_executor(self.pool, _unlink, path)
                self.recovery["over_capacity"] += 1
                continue
            self.entries[head.key] = entry
            self.entries.move_to_end(head.key, last=False)
            self.used += entry.size
            self.recovery["chunks"] += 1
            self.recovery["bytes"] += entry.size

    async def recovered(self) -> None:
        """Wait for the recovery scan to end (done, failed or cancelled)."""
        if self._scan is not None:
            await asyncio.gather(asyncio.shield(self._scan), return_exceptions=True)
