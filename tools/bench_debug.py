#!/usr/bin/env python3
"""``kvd bench --gpu`` with the daemon logging at debug level into a file.

    python tools/bench_debug.py DAEMON_LOG [bench args...]

The daemon's debug lines give, per copy, the enqueue time and the time to
completion (kvd.cuda_backend), next to the bench's end-to-end figures.
"""

import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import kvd.bench as kb
from kvd.cli import main


def _start_daemon(rundir, capacity, chunk_tokens, extra=()):
    cmd = [sys.executable, "-m", "kvd", "serve", "--runtime-dir", rundir, "--host-capacity",
           str(capacity), "--chunk-tokens", str(chunk_tokens), "--log-level", "debug", *extra]
    log = open(sys.argv[1], "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(rundir, "control.sock")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the benchmark daemon did not start")
        time.sleep(0.05)
    return proc


def summary(path):
    """Medians per (direction, MB) of the daemon's debug timings."""
    copy_re = re.compile(r"(gather|scatter) of \d+ chunks, ([\d.]+) MB, .*enqueued in ([\d.]+) ms, "
                         r"landed after ([\d.]+) ms")
    svc_re = re.compile(r"(store|load) of (\d+) chunks: ([\d.]+) ms in the service, ([\d.]+) ms")
    rows = defaultdict(list)
    svc = defaultdict(list)
    for line in open(path, errors="replace"):
        m = copy_re.search(line)
        if m:
            rows[m[1], m[2]].append((float(m[3]), float(m[4])))
        m = svc_re.search(line)
        if m:
            svc[m[1]].append((float(m[3]), float(m[4])))
    print("daemon-side medians (all shapes/pages mixed per MB):")
    for (what, mb), v in sorted(rows.items()):
        print(f"  {what:8} {mb:>7} MB  n={len(v):4}  enqueue {statistics.median(x for x, _ in v):.3f} ms"
              f"  landed {statistics.median(y for _, y in v):.3f} ms")
    for op, v in sorted(svc.items()):
        print(f"  {op:8} service {statistics.median(x for x, _ in v):.3f} ms, awaiting the copy "
              f"{statistics.median(y for _, y in v):.3f} ms (n={len(v)})")


kb._start_daemon = _start_daemon
rc = main(["bench", "--gpu", *sys.argv[2:]])
summary(sys.argv[1])
sys.exit(rc)
