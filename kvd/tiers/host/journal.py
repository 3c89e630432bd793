"""Keeps the arena's index file (kvd.tiers.host.arena_index) in step with the host tier.

Hooks on the event loop: ``committed_many`` writes shard records after their bytes landed
(with ``delay``, batches recorded ``warm_record_delay_s`` later, so shards evicted before
then cost nothing; a crash loses that window: misses, never wrong bytes), ``dropped`` frees
records before a slot is reused, ``restored``, ``flag_on_disk``; ``flush`` and
``checkpoint`` at a clean stop. Checksums run on a ``Hasher`` thread pool fed by a bounded
``SealQueue`` and only while copies are idle (``QUIET_S``): a busy daemon hashes nothing;
stale shards are skipped unread. Unsealed records are trusted on the order of writes.
Measured cost per 128-chunk store through a full tier: ~350 µs per-commit, 40-80 µs with
the delay (tools/host_tier_bench.py at commit ef6bcf2).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter, deque

import numpy as np
import xxhash

from kvd.tiers.host.arena_index import ON_DISK, ArenaIndex
from kvd.tiers.host.seal_queue import SealQueue

log = logging.getLogger("kvd")
NICE = 10  # the hashing threads' niceness (the daemon's other threads keep theirs)
QUIET_S = 0.05  # a patient job's shard is read once copies have been idle this long
CHECK_S = 0.1  # while it waits, it checks this often whether it went stale


class Hasher:
    """XXH3-64 of arena byte ranges on ``threads`` threads; results go back to the loop.

    ``submit(callback, payload, offsets, sizes, stale, patient)`` (on the loop; one job:
    a request's shards cost one queue operation); later, on the loop, ``callback(payload,
    digests, hashed)``: uint64 digests and a bool mask, False where the item was skipped
    unread as stale. ``stale()`` (None: never) returns a bool mask over the job's items;
    a hashing thread calls it before the job and again while an item waits, so skipping
    costs a few numpy operations per job, not Python per item. A ``patient`` job's items
    are read only once ``idle`` (``kvd.server.copy_gate.Idle``: an event with ``since``;
    None: always idle) has been set for ``QUIET_S``. ``stop`` ends the threads (jobs not
    done are dropped; a waiting thread ends within ``CHECK_S``).
    """

    def __init__(self, view: np.ndarray, threads: int, loop):
        self.view = view
        self.loop = loop
        self.idle = None  # the copy gate's Idle, set by the daemon once the gate exists
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # items submitted, not yet called back (loop side)
        self.stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"kvd-hash-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    @property
    def threads(self) -> int:
        return len(self._threads)

    def submit(self, callback, payload, offsets, sizes, stale=None, patient: bool = False):
        if len(offsets):
            self.pending += len(offsets)
            self.jobs.put((callback, payload, offsets, sizes, stale, patient))

    def _work(self) -> None:
        try:  # Linux schedules threads as tasks: copies get the cores first when they are short
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except OSError:
            pass
        while True:
            job = self.jobs.get()
            if job is None or not self._hash(*job) or self.stopping:
                return

    def _hash(self, callback, payload, offsets, sizes, stale, patient: bool) -> bool:
        """Hash one job's current items and hand the results back; False once stopped."""
        n = len(offsets)
        digests, hashed = np.zeros(n, np.uint64), np.zeros(n, bool)
        todo = deque(range(n) if stale is None else np.flatnonzero(~stale()).tolist())
        while todo:
            i = todo.popleft()
            if patient and not self._waited(stale, i):
                if self.stopping:
                    return False
                fresh = ~stale()  # went stale while it waited, as others evicted with it
                todo = deque(j for j in todo if fresh[j])
                continue
            view = self.view  # None once stopped
            if view is None or self.stopping:
                return False
            digests[i] = xxhash.xxh3_64_intdigest(view[offsets[i]:offsets[i] + sizes[i]])
            hashed[i] = True
        try:
            self.loop.call_soon_threadsafe(self._call_back, callback, payload, digests, hashed)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            pass
        return True

    def _waited(self, stale, i: int) -> bool:
        """Sleep off the GIL until copies have been idle for ``QUIET_S`` (a thread that
        polled would take the GIL from the loop each time); False once item ``i`` went
        stale meanwhile or the hasher stops."""
        idle = self.idle
        while idle is not None:
            if not idle.is_set():
                idle.wait(CHECK_S)
            else:
                left = QUIET_S - (time.monotonic() - idle.since)
                if left <= 0:
                    return True
                time.sleep(min(left, CHECK_S))
            if self.stopping or (stale is not None and stale()[i]):
                return False
        return True

    def _call_back(self, callback, payload, digests, hashed) -> None:
        self.pending -= len(digests)
        callback(payload, digests, hashed)

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for _ in self._threads:
            self.jobs.put(None)
        for t in self._threads:
            t.join(timeout)
        self.view = None


class Journal:
    def __init__(self, index: ArenaIndex, hasher: Hasher, live: dict | None = None,
                 delay: float = 0.0, holds=None):
        """``live``: record number -> entry, for the records an adopted tier already uses.
        ``delay`` > 0: commits wait that long (then in one batch, on ``hasher.loop``) and
        only shards the tier still ``holds(entry, rank)`` get a record; 0: at once."""
        if delay > 0 and holds is None:
            raise ValueError("a record delay needs holds(entry, rank): what the tier still holds")
        self.index = index
        self.delay = delay
        self.holds = holds
        self.later: deque = deque()  # (due, entries, rank): committed, records not written
        self.later_shards = 0
        self._flush_timer = None
        n = index.records
        self.owner: list = [None] * n  # record number -> the entry it describes, or None
        for number, entry in (live or {}).items():
            self.owner[number] = entry
        self.free = [i for i in range(n - 1, -1, -1) if self.owner[i] is None]  # low ones first
        self.counters: Counter = Counter()
        self.seals = SealQueue(hasher, n, self._sealed, self.counters)
        self.start = "new"  # how this daemon's tier began: new, clean (adopted) or crash
        self.verify = "none"  # after a crash: waiting (to serve first), running, done, stopped

    @property
    def hasher(self) -> Hasher:
        return self.seals.hasher

    @hasher.setter
    def hasher(self, hasher: Hasher) -> None:  # (tests stall it)
        self.seals.hasher = hasher

    @property
    def unsealed(self) -> int:
        """Shards whose checksum is not written yet: records due later, waiting, hashing."""
        return self.later_shards + self.seals.pending

    @property
    def sealed(self) -> int:
        return self.seals.sealed

    # ---- hooks (kvd/tiers/host/tier.py) ------------------------------------------------------

    def committed_many(self, entries: list, rank: int) -> None:
        """Each entry's shard record, then their checksums queued as one job (about 2 µs
        a shard); with a ``delay``, that much later (``_due``): one append now."""
        if self.delay <= 0:
            self._record(entries, rank)
            return
        loop = self.hasher.loop
        self.later.append((loop.time() + self.delay, entries, rank))
        self.later_shards += len(entries)  # unsealed until recorded and summed, or found gone
        if self._flush_timer is None:
            self._flush_timer = loop.call_later(self.delay, self._due)

    def _due(self) -> None:
        """Record the oldest batch once its delay is over, one batch per turn of the loop
        (a backlog never holds the loop for long), then wait for the next one."""
        self._flush_timer = None
        if not self.later:
            return
        loop = self.hasher.loop
        if self.later[0][0] <= loop.time():
            self._record_later(*self.later.popleft()[1:])
        if self.later:
            wait = self.later[0][0] - loop.time()
            self._flush_timer = (loop.call_soon(self._due) if wait <= 0 else
                                 loop.call_later(wait, self._due))

    def flush(self) -> None:
        """Record every batch still waiting, now (a stopping daemon's drain)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        while self.later:
            self._record_later(*self.later.popleft()[1:])

    def _record_later(self, entries: list, rank: int) -> None:
        """The shards of a batch the tier still holds (one evicted meanwhile, even if
        restored since, is recorded only if it holds them)."""
        self.later_shards -= len(entries)
        if not self.index.is_open:
            return
        holds = self.holds
        held = [e for e in entries if holds(e, rank)]
        self.counters["records_skipped"] += len(entries) - len(held)
        self._record(held, rank)

    def _record(self, entries: list, rank: int) -> None:
        numbers, offsets, sizes = [], [], []
        for e in entries:
            number = self.free.pop() if self.free else self._grow()
            if number is None:
                self.counters["unrecorded_shards"] += 1
                continue
            if e.recs is None:
                e.recs = [-1] * e.shards
            e.recs[rank] = number
            self.owner[number] = e
            self.index.write(number, ON_DISK if e.on_disk else 0, rank, e.shards, e.key, e.ns,
                             e.offset, e.shard_bytes, 0, e.used, e.hits)
            numbers.append(number)
            offsets.append(e.shard_offset(rank))
            sizes.append(e.shard_bytes)
        self.seals.add(numbers, offsets, sizes)

    def dropped(self, e) -> None:
        for number in e.recs or ():
            if number >= 0:
                self._release(number)

    def dropped_shard(self, e, rank: int) -> None:
        if e.recs is not None and e.recs[rank] >= 0:
            self._release(e.recs[rank])
            e.recs[rank] = -1

    def restored(self, e) -> None:
        """``e`` dropped a moment ago comes back with the same bytes: same records."""
        for number in e.recs or ():
            if number >= 0:
                self._unfree(number)
                self.owner[number] = e
                self.index.set_state(number, True)
                self.seals.restored(number)  # as it was: its checksum is current again

    def flag_on_disk(self, e) -> None:
        for number in e.recs or ():
            if number >= 0:
                self.index.set_flag(number, ON_DISK, e.on_disk)

    # ---- records --------------------------------------------------------------------------

    def _grow(self) -> int | None:
        """A record number from a table grown for it, or None (shm_dir is full)."""
        old = self.index.records
        if not self.index.grow():
            return None
        new = self.index.records
        self.owner.extend([None] * (new - old))
        self.seals.grow(new)
        self.free.extend(range(new - 1, old - 1, -1))
        return self.free.pop()

    def _release(self, number: int) -> None:
        self.index.set_state(number, False)
        self.seals.freed(number)  # before the slot can be reused: its checksum is stale now
        self.owner[number] = None
        self.free.append(number)

    def _unfree(self, number: int) -> None:
        for i in range(len(self.free) - 1, -1, -1):  # freed just now: near the end
            if self.free[i] == number:
                del self.free[i]
                return

    # ---- checksums ------------------------------------------------------------------------

    def seal(self, number: int, offset: int, size: int) -> None:
        """Queue the checksum of adopted record ``number``'s bytes (as it is)."""
        self.seals.add([number], [offset], [size], handed_out=False)

    def _sealed(self, number: int, digest: int) -> None:
        """Record ``number``'s checksum came back, for the bytes it still describes."""
        e = self.owner[number]
        if e is not None and self.index.is_open:
            self.index.seal(number, digest, ON_DISK if e.on_disk else 0)

    # ---- a clean stop ---------------------------------------------------------------------

    def checkpoint(self, entries) -> None:
        """Write the last use and hits of every entry's records (after the loop stopped)."""
        numbers, used, hits = [], [], []
        for e in entries:
            for number in e.recs or ():
                if number >= 0:
                    numbers.append(number)
                    used.append(e.used)
                    hits.append(min(e.hits, 2**32 - 1))
        if numbers:
            self.index.checkpoint(np.array(numbers), np.array(used, np.uint64),
                                  np.array(hits, np.uint32))

    def stats(self) -> dict:
        c = self.counters
        return {"start": self.start, "verify": self.verify, "adopted_chunks": c["adopted_chunks"],
                "bad_records": c["bad_records"], "verify_pending": c["verify_pending"],
                "verified_shards": c["verified_shards"], "checksum_failures": c["checksum_failures"],
                "verify_seconds": c["verify_seconds"], "unsealed_shards": self.unsealed,
                "sealed_shards": self.sealed, "checksums_skipped": c["checksums_skipped"],
                "checksums_stale": c["checksums_stale"], "unrecorded_shards": c["unrecorded_shards"],
                "records_pending": self.later_shards, "records_skipped": c["records_skipped"],
                "index_records": self.index.records}
