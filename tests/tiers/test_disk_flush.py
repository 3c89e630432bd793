"""``kvd ctl flush-disk`` as an operator runs it, on a real daemon with a disk tier.

A flush that takes longer than the old 5 s default finishes (the daemon's
writes slowed by tests/disk_faults.py's ``slow_write``), with progress
lines on stderr meanwhile; and a flush writes every host chunk whatever
``disk_min_hits`` says, while demotion by watermark still skips chunks
with too few hits.
"""

from __future__ import annotations

import subprocess
import sys
import time

import workers_disk as D
from disk_faults import SLOW_WRITE_S
from test_disk_tier import SPEC, chunk_files, disk_knobs, disk_stats


def flush(d, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd", "ctl", "flush-disk", "--runtime-dir",
                           str(d.runtime_dir), *extra], capture_output=True, text=True,
                          timeout=120)


def test_a_flush_longer_than_5_s_finishes_with_progress_lines(start_daemon, procs, tmp_path):
    d = start_daemon(faults="slow_write", **disk_knobs(tmp_path, disk_io_threads=1))
    chunks = 8  # 8 x 0.75 s of writes, one at a time: 6 s
    assert chunks * SLOW_WRITE_S > 5.5
    assert procs.apply(D.store_seqs, (str(d.runtime_dir), SPEC, 61, 2, chunks // 2, "flush/slow",
                                      False)) == chunks * D.CHUNK
    t0 = time.monotonic()
    out = flush(d)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"flush-disk: wrote {chunks} chunks to the disk tier; its write queue is empty\n"
    progress = out.stderr.splitlines()
    assert took > 5 and len(progress) >= 2, out.stderr
    assert all(line.startswith("flush-disk: ") and " chunks written (" in line for line in progress)
    assert len(chunk_files(tmp_path)) == chunks
    slow = flush(d, "--timeout", "1")  # nothing left to write: answers at once, no progress
    assert slow.returncode == 0 and slow.stderr == "" and "wrote 0 chunks" in slow.stdout
    assert d.stop() == 0


def test_flush_writes_every_chunk_whatever_disk_min_hits_says(start_daemon, procs, tmp_path):
    """disk_min_hits = 1: the demoter (host tier above its watermark) skips chunks never
    looked up; an operator's flush writes them all."""
    d = start_daemon(**disk_knobs(tmp_path, disk_min_hits=1, disk_high_watermark=0.1))
    rd = str(d.runtime_dir)
    assert procs.apply(D.store_seqs, (rd, SPEC, 62, 2, 2, "flush/hits", False)) == 4 * D.CHUNK
    deadline = time.monotonic() + 10  # 4 of 16 chunks: above the watermark, the demoter runs
    while disk_stats(d)["demotions_skipped_cold"] < 4:
        assert time.monotonic() < deadline, disk_stats(d)
        time.sleep(0.05)
    assert disk_stats(d)["chunks"] == 0  # skipped as cold, not written
    out = flush(d)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("flush-disk: wrote 4 chunks ")
    assert disk_stats(d)["chunks"] == 4 and len(chunk_files(tmp_path)) == 4
    assert d.stop() == 0
