"""The checksums the arena index's records wait for: bounded, one flag per record.

The journal hands each record written to ``add``; it waits (a flag in ``state``) until a
batch goes to the ``Hasher`` (at most ``MAX_JOBS_PER_THREAD`` jobs of ``BATCH`` records per
thread). Bounded by the index table whatever the traffic: a record written twice waits
once, one freed stops waiting (``freed``), one restored waits again. Generations (``gen``)
let hashing threads skip stale records (``stale``) and ``on_digest`` apply only to the
generation read. Everything but ``stale`` runs on the event loop: no locks.
"""

from __future__ import annotations

from functools import partial

import numpy as np

BATCH = 256  # records per hashing job
MAX_JOBS_PER_THREAD = 2  # jobs with the hasher at once, per hashing thread
SCAN = 1 << 16  # records looked at per step when picking waiting ones
IDLE, WAITING, HASHING, SEALED = 0, 1, 2, 3  # a record's checksum: none wanted, ..., written


class SealQueue:
    def __init__(self, hasher, records: int, on_digest, counters):
        self.hasher = hasher
        self.on_digest = on_digest  # (number, digest) of a record still as it was read
        self.counters = counters  # the journal's: checksums_skipped, checksums_stale
        self.gen = np.zeros(records, np.int64)
        self.state = np.zeros(records, np.int8)
        self.read_gen = np.zeros(records, np.int64)  # the generation its HASHING job reads
        self.offset = np.zeros(records, np.int64)
        self.size = np.zeros(records, np.int64)
        self.waiting = 0  # records in WAITING
        self.hashing = 0  # records in jobs with the hasher (stale ones included)
        self.jobs = 0
        self.sealed = 0
        self._cursor = 0

    @property
    def pending(self) -> int:
        """Checksums not written yet: waiting here or with the hasher."""
        return self.waiting + self.hashing

    def grow(self, records: int) -> None:
        extra = records - len(self.gen)
        for name in ("gen", "state", "read_gen", "offset", "size"):
            old = getattr(self, name)
            setattr(self, name, np.concatenate([old, np.zeros(extra, old.dtype)]))

    # ---- the journal's events -------------------------------------------------------------

    def add(self, numbers: list, offsets: list, sizes: list, handed_out: bool = True) -> None:
        """Records ``numbers`` (distinct) now describe these byte ranges: checksum them.
        ``handed_out``: newly given to a shard (a new generation); False for a record
        adopted as it is."""
        if not numbers:
            return
        idx = np.array(numbers, np.int64)
        if handed_out:
            self.gen[idx] += 1
        self.offset[idx] = offsets
        self.size[idx] = sizes
        self.waiting += len(idx) - int(np.count_nonzero(self.state[idx] == WAITING))
        self.state[idx] = WAITING
        if self.jobs < self._max_jobs() and len(idx) <= BATCH:
            self._submit(idx)  # fresh: no scan needed
        else:
            self.feed()

    def freed(self, number: int) -> None:
        self.gen[number] += 1  # a job holding it skips it now
        if self.state[number] == WAITING:
            self.state[number] = IDLE
            self.waiting -= 1
            self.counters["checksums_skipped"] += 1

    def restored(self, number: int) -> None:
        """Freed a moment ago, back with the same bytes: waits again if it was waiting."""
        self.gen[number] -= 1  # as it was: a job holding it is current again
        if self.state[number] == IDLE:
            self.state[number] = WAITING
            self.waiting += 1
            self.feed()

    # ---- jobs ------------------------------------------------------------------------------

    def _max_jobs(self) -> int:
        return MAX_JOBS_PER_THREAD * self.hasher.threads

    def feed(self) -> None:
        """Hand waiting records to the hasher while it has room for another job."""
        while self.waiting and self.jobs < self._max_jobs():
            idx = self._take(BATCH)
            if not len(idx):  # cannot be: ``waiting`` counts the flags
                raise RuntimeError(f"{self.waiting} checksums counted waiting, none flagged")
            self._submit(idx)

    def _take(self, most: int) -> np.ndarray:
        """Up to ``most`` waiting record numbers, round robin from where the last ended
        (a window of ``SCAN`` flags at a time: one numpy pass each)."""
        n = len(self.state)
        found, got, start, scanned = [], 0, self._cursor % n, 0
        while got < most and scanned < n:
            end = min(start + SCAN, start + n - scanned, n)  # each flag once
            hits = np.flatnonzero(self.state[start:end] == WAITING)[:most - got] + start
            found.append(hits)
            got += len(hits)
            scanned += end - start
            start = int(hits[-1]) + 1 if got == most else end
            start = 0 if start >= n else start
        self._cursor = start
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    def _submit(self, idx: np.ndarray) -> None:
        self.state[idx] = HASHING
        self.waiting -= len(idx)
        self.hashing += len(idx)
        self.jobs += 1
        gens = self.read_gen[idx] = self.gen[idx]
        self.hasher.submit(self._done, (idx, gens), self.offset[idx].tolist(),
                           self.size[idx].tolist(), partial(self.stale, idx, gens), patient=True)

    def stale(self, idx: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Which of a job's records were freed or reused since (from a hashing thread; a
        change right after is caught again in ``_done``)."""
        return self.gen[idx] != gens

    def _done(self, payload, digests: np.ndarray, hashed: np.ndarray) -> None:
        idx, gens = payload
        self.jobs -= 1
        self.hashing -= len(idx)
        current = self.gen[idx] == gens
        # not handed out again meanwhile (then WAITING, or HASHING in a later job)
        mine = (self.state[idx] == HASHING) & (self.read_gen[idx] == gens)
        ours = np.flatnonzero(mine & current)
        done, back = ours[hashed[ours]], ours[~hashed[ours]]  # back: freed, restored since
        self.state[idx[done]] = SEALED
        self.state[idx[back]] = WAITING
        self.sealed += len(done)
        self.waiting += len(back)
        for number, digest in zip(idx[done].tolist(), digests[done].tolist()):
            self.on_digest(number, digest)
        self.state[idx[mine & ~current]] = IDLE
        self.counters["checksums_skipped"] += len(idx) - int(np.count_nonzero(hashed)) - len(back)
        self.counters["checksums_stale"] += int(np.count_nonzero(hashed & ~current))
        self.feed()
