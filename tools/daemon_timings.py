#!/usr/bin/env python3
"""Medians of the daemon's per-copy debug timings, next to a bench run.

    python3 -m kvd bench --gpu --daemon-log /tmp/kvd-debug.log
    python3 tools/daemon_timings.py /tmp/kvd-debug.log

kvd.cuda.backend logs, per copy, how long queuing took and when the copy
landed; kvd.server.service logs the time spent in the service around each copy.
"""

import re
import statistics
import sys
from collections import defaultdict


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


if __name__ == "__main__":
    summary(sys.argv[1])
