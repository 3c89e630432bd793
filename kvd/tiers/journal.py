"""Keeps the arena's index file (kvd/tiers/arena_index.py) in step with the host tier.

The host tier calls the hooks on the event loop: ``committed_many(entries, rank)``
writes each shard's record (after its bytes landed; about 1 µs), and queues
its checksum; ``dropped(entry)`` frees the entry's records before its slot
can be reused; ``restored(entry)`` takes them back (an eviction undone);
``flag_on_disk(entry)``. Record numbers come from a free list; the table
doubles when it is full (a full shm_dir: the shard goes unrecorded,
counted in ``unrecorded_shards``, and is simply not adopted next time).

Checksums are computed off the event loop and off the store's path: a
``Hasher`` thread pool takes (offset, size) jobs, XXH3-64s the arena bytes
(xxhash releases the GIL; the threads run at niceness ``NICE``, so where
cores are short the copies get them first) and hands the digests back to
the loop in batches, where ``_sealed`` writes the digest and the ``SEALED`` flag into
the record -- if the record still belongs to the shard it was queued for
(per-record generation, bumped on each reuse; the bytes may have been
evicted meanwhile and the digest then describes nothing). A thread skips
a shard whose record was freed or reused before its turn came, without
reading its bytes: under a stream of stores the queue runs behind, its
oldest shards are evicted first, and hashing them read host memory for
nothing next to the copy engines (with the journal off, DeepSeek-MLA pages
moved both ways at 0.94-0.98 of a memcpy instead of 0.73-0.93, H100;
host-backend stores on a 2-core VM 3.59 GB/s with the skip, 3.35 without;
docs/benchmarks.md). The store's
reply does not wait for it: a shard committed in the last milliseconds
before a crash has a record without a digest, which a new daemon trusts on
the order of writes alone (the record is written after the bytes landed
and freed before the slot is reused) and seals then.

``checkpoint`` (at a clean stop, after the loop stopped) writes every
entry's last-use clock and hits, so the next daemon rebuilds the LRU order
exactly; after a crash the order is that of the last commit or clean stop.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import Counter

import numpy as np
import xxhash

from kvd.tiers.arena_index import ON_DISK, ArenaIndex

log = logging.getLogger("kvd")
BATCH_BYTES = 64 * 2**20  # a hashing thread hands results back at least this often
NICE = 10  # the hashing threads' niceness (the daemon's other threads keep theirs)


class Hasher:
    """XXH3-64 of arena byte ranges on ``threads`` threads; results go back to the loop.

    ``submit_many(callback, items, current)`` (on the loop; items: ``(payload, offset,
    size)``, one job: a request's shards cost one queue operation); later, on the loop,
    ``callback(payload, digest)`` for each, with digest None for an item that
    ``current(payload)`` (called on a hashing thread right before the item's turn)
    found stale. ``stop`` ends the threads (jobs not done are dropped).
    """

    def __init__(self, view: np.ndarray, threads: int, loop):
        self.view = view
        self.loop = loop
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # items submitted, not yet called back (loop side)
        self.stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"kvd-hash-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def submit_many(self, callback, items: list, current=None) -> None:
        if items:
            self.pending += len(items)
            self.jobs.put((callback, items, current))

    def _work(self) -> None:
        try:  # Linux schedules threads as tasks: copies get the cores first when they are short
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except OSError:
            pass
        while True:
            job = self.jobs.get()
            if job is None or not self._hash(*job) or self.stopping:
                return

    def _hash(self, callback, items: list, current) -> bool:
        """Hash one job's items, handing results back every ``BATCH_BYTES``; False once
        stopped."""
        batch, nbytes = [], 0
        for payload, offset, size in items:
            view = self.view  # None once stopped
            if view is None:
                return False
            if current is not None and not current(payload):
                batch.append((callback, payload, None))
                continue
            batch.append((callback, payload, xxhash.xxh3_64_intdigest(view[offset:offset + size])))
            nbytes += size
            if nbytes >= BATCH_BYTES:
                self._deliver(batch)
                batch, nbytes = [], 0
        if batch:
            self._deliver(batch)
        return True

    def _deliver(self, batch: list) -> None:
        try:
            self.loop.call_soon_threadsafe(self._call_back, batch)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            pass

    def _call_back(self, batch: list) -> None:
        self.pending -= len(batch)
        for callback, payload, digest in batch:
            callback(payload, digest)

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for _ in self._threads:
            self.jobs.put(None)
        for t in self._threads:
            t.join(timeout)
        self.view = None


class Journal:
    def __init__(self, index: ArenaIndex, hasher: Hasher, live: dict | None = None):
        """``live``: record number -> entry, for the records an adopted tier already uses."""
        self.index = index
        self.hasher = hasher
        n = index.records
        self.owner: list = [None] * n  # record number -> the entry it describes, or None
        self.gen = [0] * n              # bumped each time a record number is handed out
        for number, entry in (live or {}).items():
            self.owner[number] = entry
        self.free = [i for i in range(n - 1, -1, -1) if self.owner[i] is None]  # low ones first
        self.unsealed = 0
        self.sealed = 0
        self.start = "new"  # how this daemon's tier began: new, clean (adopted) or crash
        self.verify = "none"  # after a crash: waiting (to serve first), running, done, stopped
        self.counters: Counter = Counter()

    # ---- hooks (kvd/tiers/host.py) ------------------------------------------------------

    def committed_many(self, entries: list, rank: int) -> None:
        """Each entry's shard record, then their checksums queued as one job (the hot
        path: about 2 µs a shard)."""
        jobs = []
        for e in entries:
            number = self.free.pop() if self.free else self._grow()
            if number is None:
                self.counters["unrecorded_shards"] += 1
                continue
            self.gen[number] += 1
            if e.recs is None:
                e.recs = [-1] * e.shards
            e.recs[rank] = number
            self.owner[number] = e
            self.index.write(number, ON_DISK if e.on_disk else 0, rank, e.shards, e.key, e.ns,
                             e.offset, e.shard_bytes, 0, e.used, e.hits)
            jobs.append(((number, self.gen[number]), e.shard_offset(rank), e.shard_bytes))
        self.unsealed += len(jobs)
        self.hasher.submit_many(self._sealed, jobs, self._current)

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
        self.gen.extend([0] * (new - old))
        self.free.extend(range(new - 1, old - 1, -1))
        return self.free.pop()

    def _release(self, number: int) -> None:
        self.index.set_state(number, False)
        self.owner[number] = None
        self.free.append(number)

    def _unfree(self, number: int) -> None:
        for i in range(len(self.free) - 1, -1, -1):  # freed just now: near the end
            if self.free[i] == number:
                del self.free[i]
                return

    # ---- checksums ------------------------------------------------------------------------

    def seal(self, number: int, offset: int, size: int) -> None:
        """Queue the checksum of record ``number``'s bytes."""
        self.unsealed += 1
        self.hasher.submit_many(self._sealed, [((number, self.gen[number]), offset, size)],
                                self._current)

    def _current(self, payload) -> bool:
        """Whether record ``number`` still describes the shard of generation ``gen`` (read
        from a hashing thread: list reads are atomic; a drop right after is caught again
        in ``_sealed``)."""
        number, gen = payload
        return self.gen[number] == gen and self.owner[number] is not None

    def _sealed(self, payload, digest: int | None) -> None:
        number = payload[0]
        self.unsealed -= 1
        if digest is None:  # freed or reused before its turn: nothing to seal
            self.counters["checksums_skipped"] += 1
            return
        if self._current(payload) and self.index.is_open:
            self.index.seal(number, digest, ON_DISK if self.owner[number].on_disk else 0)
            self.sealed += 1

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
                "unrecorded_shards": c["unrecorded_shards"],
                "index_records": self.index.records}
