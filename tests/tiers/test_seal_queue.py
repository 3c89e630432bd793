"""The journal's checksum queue (kvd/tiers/host/seal_queue.py) stays bounded whatever the traffic.

A ``SealQueue`` over a hasher double that keeps the jobs it is given (as
real hashing threads do while copies never pause): under a stream of
records handed out, freed and handed out again, the hasher never holds more
than its few jobs and what waits is at most one flag per record.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvd.tiers.host import seal_queue
from kvd.tiers.host.seal_queue import BATCH, MAX_JOBS_PER_THREAD, SealQueue

RECORDS = 2048


class HeldHasher:
    """Keeps every job (a thread waiting for the copies to pause); ``finish`` hands one back."""

    threads = 2

    def __init__(self):
        self.jobs = []

    def submit(self, callback, payload, offsets, sizes, stale=None, patient=False):
        self.jobs.append((callback, payload, offsets, sizes, stale))

    def finish(self, read_stale: bool = False) -> None:
        callback, payload, offsets, _, stale = self.jobs.pop(0)
        hashed = np.ones(len(offsets), bool) if read_stale else ~stale()
        callback(payload, np.arange(len(offsets), dtype=np.uint64) + 7, hashed)


def queue():
    digests = {}
    counters = Counter()
    q = SealQueue(HeldHasher(), RECORDS, lambda n, d: digests.__setitem__(n, d), counters)
    return q, digests, counters


@pytest.mark.parametrize("scan", [1 << 16, 100])  # 100: waiting ones found window by window
def test_a_stream_of_records_costs_a_flag_each_not_a_job_each(scan, monkeypatch):
    monkeypatch.setattr(seal_queue, "SCAN", scan)
    q, digests, counters = queue()
    rng = np.random.default_rng(3)
    live = set()
    for _ in range(40_000):  # one record per store, freed as the tier turns over
        number = int(rng.integers(RECORDS))
        if number in live:
            q.freed(number)
        q.add([number], [number * 4096], [4096])
        live.add(number)
        assert len(q.hasher.jobs) <= MAX_JOBS_PER_THREAD * q.hasher.threads
        assert q.waiting <= RECORDS and q.pending <= RECORDS + 4 * BATCH
        if rng.random() < 0.01:  # copies paused: a job comes back
            q.hasher.finish()
    assert q.waiting == int(np.count_nonzero(q.state == 1))
    assert counters["checksums_skipped"] > 5_000  # freed while waiting: dropped unread
    while q.hasher.jobs:  # copies stop: everything still live is sealed, once
        q.hasher.finish()
    assert q.pending == 0 and set(digests) == live  # each live record's latest generation
    assert np.count_nonzero(q.state == 3) == len(live)


def test_a_record_freed_while_waiting_is_dropped_and_restored_waits_again():
    q, digests, counters = queue()
    q.add(list(range(4 * BATCH)), [0] * 4 * BATCH, [4096] * 4 * BATCH)  # 4 jobs held
    q.add([1500, 1501], [0, 0], [4096, 4096])
    assert q.waiting == 2 and len(q.hasher.jobs) == 4
    q.freed(1500)
    assert q.waiting == 1 and counters["checksums_skipped"] == 1
    q.restored(1500)  # an eviction undone: same bytes, waits again
    assert q.waiting == 2
    q.freed(1501)
    q.add([1501], [0], [4096])  # freed and handed out again before its turn: one flag
    assert q.waiting == 2
    q.hasher.finish()  # a job done: the waiting ones go next
    assert q.waiting == 0 and len(q.hasher.jobs) == 4
    while q.hasher.jobs:
        q.hasher.finish()
    assert q.pending == 0 and q.sealed == 4 * BATCH + 2 and len(digests) == 4 * BATCH + 2


def test_a_digest_read_after_the_record_was_freed_is_not_written():
    q, digests, counters = queue()
    q.add([5], [0], [4096])
    q.freed(5)  # while its job is with the hasher
    q.hasher.finish(read_stale=True)  # read before the hashing thread saw it go stale
    assert 5 not in digests and counters["checksums_stale"] == 1 and q.pending == 0
    q.add([5], [0], [4096])  # handed out again: a new generation, sealed
    q.hasher.finish()
    assert digests == {5: 7}
