"""The host tier at start-up and at exit: adopt the arena a previous daemon left, or make one.

``HostTierSetup.open()`` (under the runtime dir's lock) adopts ``kvd-arena-<tag>`` when
``warm_restart`` is on, ``cold_start`` off and its index (kvd.tiers.host.arena_index) matches
this format, capacity, alignment and ``chunk_tokens``: mapped without zeroing, rebuilt on a
thread (kvd.tiers.host.adopt), after a crash verified in the background while serving; it first
waits for a still-exiting previous owner, whose last DMA must not land in a reused slot.
Anything else found is deleted with one line saying why, and a new arena is allocated.
``drain`` waits for pending checksums; ``close`` keeps both files for the next start (one
line with the ``kvd drop-tier`` command) or removes them. The index is marked clean only
when no adopted chunk waits for verification.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from pathlib import Path

from kvd.config import size_text
from kvd.server.kept_tier import drop_command
from kvd.tiers.host.adopt import rebuild, verify
from kvd.tiers.host.arena import AllocationStopped, SharedArena, arena_path
from kvd.tiers.host.arena_index import CLEAN, ArenaIndex, IndexProblem, index_path, process_state
from kvd.tiers.host.journal import Hasher, Journal
from kvd.tiers.host.quota import QuotaBook
from kvd.tiers.host.tier import HostTier
from kvd.tiers.progress import Progress
from kvd_protocol.runtime import instance_tag

log = logging.getLogger("kvd")
EXTEND_S = 30.0  # each start-up STATUS moves systemd's start timeout this far out
OWNER_EXIT_S = 30.0


class HostTierSetup:
    def __init__(self, cfg, runtime_dir: Path, notifier, abort):
        self.cfg = cfg
        self.runtime_dir = runtime_dir
        self.notifier = notifier
        self.abort = abort  # threading.Event: a signal came, stop the allocation
        self.path = arena_path(Path(cfg.shm_dir), instance_tag(runtime_dir))
        self.index_path = index_path(self.path)
        self.align = 4096 if cfg.disk_dir else 256  # 4096: disk IO straight to/from slots
        self.arena = self.tier = self.journal = self.adoption = None
        self.started = "new"  # or "clean" (adopted after a clean stop), "crash"
        self.stop_signal = None  # set by the daemon with ``abort``: the signal's name
        self._verifying = None

    # ---- start-up -------------------------------------------------------------------

    async def open(self) -> bool:
        """Adopt or allocate; False when a signal stopped it."""
        index = await self._adoptable()
        cap = self.cfg.host_capacity
        self.tier = self._new_tier()
        if index is not None:
            self.arena = await self._map(adopt=True)
            if self.arena is None:
                index.close(clean=False)
                return False
            if not await self._rebuild(index, index.head["state"] != CLEAN):
                index = None
        if self.arena is None:
            self.arena = await self._map(adopt=False)
            if self.arena is None:
                return False
            if self.cfg.warm_restart:
                index = ArenaIndex.create(self.index_path, self.arena.stat, cap, self.align,
                                          self.cfg.chunk_tokens)
        if index is not None:
            hasher = Hasher(self.arena.view, self.cfg.verify_threads, asyncio.get_running_loop())
            live = self.adoption.live if self.adoption else None
            self.journal = self.tier.journal = Journal(index, hasher, live,
                                                       self.cfg.warm_record_delay_s, self.tier.holds)
            self.journal.start = self.started
            if self.adoption is not None:
                self.journal.counters["adopted_chunks"] = len(self.adoption.entries)
                self.journal.counters["bad_records"] = self.adoption.bad_records
            for number, offset, size in (self.adoption.unsealed if self.adoption else ()):
                self.journal.seal(number, offset, size)
            if self.adoption is not None and self.adoption.checks:
                self.journal.verify = "waiting"
        return True

    def _new_tier(self) -> HostTier:
        """An empty host tier, keeping the ``quota`` knob's rules (kvd/tiers/host/quota.py)."""
        book = QuotaBook(self.cfg.quota) if self.cfg.quota else None
        return HostTier(self.cfg.host_capacity, self.align, book)

    async def _rebuild(self, index: ArenaIndex, crashed: bool) -> bool:
        """The host tier from ``index`` (on a thread: pure Python over every record). On a
        bug of ours: logged, the files deleted, False (a new arena is made): never a crash
        loop over a file we cannot read."""
        loop = asyncio.get_running_loop()
        cap = self.cfg.host_capacity
        gc.disable()  # an object per entry, none garbage: collections would take 60% of it
        try:
            self.adoption = await loop.run_in_executor(None, rebuild, index, cap, self.align,
                                                       crashed)
            self.tier.adopt(self.adoption.entries)
        except Exception:  # noqa: BLE001 - see above
            log.exception("host tier at %s could not be adopted (a bug in kvd, please report "
                          "it); deleting it and starting empty", self.path)
            index.close(clean=False)
            self.arena.close(keep=False)
            self.index_path.unlink(missing_ok=True)
            self.arena, self.adoption, self.tier = None, None, self._new_tier()
            return False
        finally:
            gc.enable()
        self._log_adoption(index.head["pid"])
        index.adopted()
        self.started = "crash" if crashed else "clean"
        return True

    async def _adoptable(self):
        """The index of an arena this daemon may adopt, or None (anything found is removed)."""
        if not self.path.exists() and not self.index_path.exists():
            return None
        if not self.cfg.warm_restart or self.cfg.cold_start:
            why = "cold_start (--cold)" if self.cfg.cold_start else "warm_restart is off"
            self._discard(f"{why}: deleted the host tier a previous daemon left at {self.path}")
            return None
        try:
            index = ArenaIndex.open(self.index_path)
        except IndexProblem as exc:
            self._discard(f"host tier at {self.path} not adopted ({exc}): deleted it")
            return None
        try:
            problem = index.problem(self.path.stat(), self.cfg.host_capacity, self.align,
                                    self.cfg.chunk_tokens)
        except FileNotFoundError:
            problem = "its arena file is missing"
        if problem is None and not await self._owner_gone(index):
            problem = f"its previous owner (pid {index.head['pid']}) is still exiting"
        if problem is not None:
            index.close(clean=False)
            self._discard(f"host tier at {self.path} not adopted ({problem}): deleted it")
            return None
        return index

    def _discard(self, what: str) -> None:
        log.warning("%s; starting empty", what)
        self.path.unlink(missing_ok=True)
        self.index_path.unlink(missing_ok=True)

    async def _owner_gone(self, index: ArenaIndex) -> bool:
        pid, start = index.head["pid"], index.head["start"]
        deadline = time.monotonic() + OWNER_EXIT_S
        if process_state(pid, start) not in (None, "Z", "X"):
            log.info("waiting for the previous daemon (pid %d) to exit before adopting its "
                     "host tier", pid)
        while process_state(pid, start) not in (None, "Z", "X"):
            if time.monotonic() > deadline or self.abort.is_set():
                return False
            await asyncio.sleep(0.05)
        return True

    async def _map(self, adopt: bool):
        """The arena, mapped (``adopt``) or allocated on a thread (the loop keeps handling
        signals and the watchdog), with progress in the log and systemd's status; None when
        a signal stopped it."""
        size = self.cfg.host_capacity
        doing = "mapping the host tier to adopt it" if adopt else "allocating the host tier"
        where = f"{size_text(size)} at {self.path}"
        log.info("%s: %s", doing, where)
        self.notifier.status(f"{doing}: {where}", extend_s=EXTEND_S)
        progress = Progress(size)

        def on_progress(done: int) -> None:  # on the allocating thread
            if done < size and progress.due():
                text, fields = progress.report(done)
                log.info("%s: %s", doing, text, extra={"progress": fields})
                self.notifier.status(f"{doing}: {text}", extend_s=EXTEND_S)

        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(None, lambda: SharedArena(self.path, size, self.abort,
                                                             on_progress, adopt))
        try:
            arena = await asyncio.shield(job)
        except asyncio.CancelledError:  # stop the thread and remove what it made, then go
            self.abort.set()
            made = (await asyncio.gather(job, return_exceptions=True))[0]
            if isinstance(made, SharedArena):
                made.close(keep=adopt)
            raise
        except AllocationStopped as stop:
            left = "the host tier left as it was" if adopt else "nothing left behind"
            log.info("start-up interrupted by %s while %s (%.0f%% of %s done): stopped, %s",
                     self.stop_signal, doing, 100 * stop.done / stop.size, size_text(size), left)
            return None
        secs = max(arena.setup_seconds, 1e-9)
        huge = arena.huge_pages
        log.info("host tier: %s at %s, %s in %.2f s (%.2f GiB/s)%s", size_text(size), arena.path,
                 "mapped" if adopt else "allocated", secs, size / secs / 2**30,
                 f", {huge / size:.0%} in huge pages" if huge else "")
        return arena

    def _log_adoption(self, previous_pid: int) -> None:
        a = self.adoption
        how = ("after a clean stop: every chunk trusted" if not a.crashed else
               f"after a crash of pid {previous_pid}: {len(a.checks)} shards to verify in "
               "the background (no hits until checked)")
        log.info("host tier adopted: %d chunks (%s) %s%s", len(a.entries), size_text(a.bytes) if
                 a.bytes else "0 bytes", how,
                 f"; {a.bad_records} inconsistent records dropped" if a.bad_records else "")

    # ---- serving ------------------------------------------------------------------------

    def start_verify(self) -> None:
        """After a crash: verify the adopted chunks in the background (the loop serves on)."""
        if self.adoption is not None and self.adoption.checks:
            self._verifying = asyncio.ensure_future(self._verify())

    async def _verify(self) -> None:
        checks = self.adoption.checks
        nbytes = sum(e.shard_bytes for e, _, _ in checks)
        self.journal.verify = "running"
        try:
            await verify(self.tier, self.journal, checks)
        except asyncio.CancelledError:
            self.journal.verify = "stopped"
            raise
        self.journal.verify = "done"
        c = self.journal.counters
        secs = max(c["verify_seconds"], 1e-9)
        log.info("host tier verified: %d shards good, %d failed their checksum (dropped), %d "
                 "evicted before their turn; %.2f s (%.2f GiB/s)", c["verified_shards"],
                 c["checksum_failures"], c["verify_skipped"], secs, nbytes / secs / 2**30)
        self.adoption.checks = []

    # ---- stopping -----------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Stop verifying; wait (at most ``timeout``) for the checksums being computed."""
        if self._verifying is not None:
            self._verifying.cancel()
            await asyncio.gather(self._verifying, return_exceptions=True)
        if self.journal is not None:
            self.journal.flush()  # the records still waiting for their delay, then their sums
        deadline = time.monotonic() + timeout
        while self.journal is not None and self.journal.unsealed and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def close(self, served: bool) -> None:
        """After the loop: keep the arena for the next daemon (warm_restart) or remove it;
        one this start-up made and never served with is removed too (nothing left behind)."""
        if self.arena is None:
            return
        keep = self.journal is not None and (served or self.started != "new")
        if self.journal is not None:
            self.journal.hasher.stop()
            if keep:
                self.journal.flush()  # when drain did not run (records unsealed, trusted)
                self.journal.checkpoint(self.tier.entries.values())
            # chunks adopted after a crash and not verified yet: the next start verifies
            unverified = self.adoption is not None and bool(self.adoption.checks)
            self.journal.index.close(clean=keep and not unverified)
        self.arena.close(keep=keep)
        if keep:
            log.info("host tier kept at %s for the next start: %d chunks, %s used", self.path,
                     self.tier.ready_count,
                     size_text(self.tier.alloc.used) if self.tier.alloc.used else "0 bytes")
            shm_dir = Path(self.cfg.shm_dir)  # the memory stays taken: say how to give it back
            log.info("the host tier (%s) stays in %s for a warm restart; `%s` frees it",
                     size_text(self.cfg.host_capacity), shm_dir,
                     drop_command(shm_dir, self.runtime_dir))
        else:
            self.index_path.unlink(missing_ok=True)
        self.arena = None
