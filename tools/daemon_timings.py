#!/usr/bin/env python3
"""Medians of the daemon's per-copy debug timings, next to a bench run.

    python3 -m kvd bench --gpu --daemon-log /tmp/kvd-debug.log
    python3 tools/daemon_timings.py /tmp/kvd-debug.log [--phases]

kvd.cuda.backend logs, per copy, how long queuing took and when the copy
landed; kvd.server.service logs the time spent in the service around each copy.

``--phases`` also splits the log into phases (one direction, or both
mixed; see ``phases``) and prints per phase and direction:
GB/s over the phase, the fraction of the phase during which a copy of that
direction was queued on the GPU (from the end of its enqueue to its
landing), the idle gaps between copies, and how many copies of that
direction were queued at once (median at each copy's start). A direction
that idles between copies while the daemon queues the next is host-bound.
"""

import re
import statistics
import sys
from collections import defaultdict
from datetime import datetime

COPY_RE = re.compile(r"^(\S+ \S+) \S+ DEBUG (gather|scatter) of \d+ chunks, ([\d.]+) MB, (.*?): "
                     r"enqueued in ([\d.]+) ms, landed after ([\d.]+) ms")


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


def copies(path):
    """Each logged copy: direction, MB, start, end of its enqueue, landing (seconds)."""
    out = []
    for line in open(path, errors="replace"):
        m = COPY_RE.match(line)
        if m:
            land = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            start = land - float(m[6]) / 1e3
            out.append({"dir": m[2], "mb": float(m[3]), "start": start,
                        "queued": start + float(m[5]) / 1e3, "land": land})
    return sorted(out, key=lambda c: c["start"])


def phases(cs):
    """Runs of copies without a 30 ms pause, cut where the next four copies change from
    one direction to both, from both to one, or to the other direction."""
    out, cur = [], []
    for i, c in enumerate(cs):
        if cur:
            ahead, last = {x["dir"] for x in cs[i:i + 4]}, {x["dir"] for x in cur[-4:]}
            paused = c["start"] - max(x["land"] for x in cur) > 0.03
            if paused or (len(cur) >= 4 and ((len(last) == 2) != (len(ahead) == 2)
                                             or (len(last) == 1 and ahead != last
                                                 and len(ahead) == 1))):
                out.append(cur)
                cur = []
        cur.append(c)
    return [p for p in out + [cur] if len(p) >= 4]


def occupancy(path):
    print("phases (per direction: GB/s, fraction of the phase with a copy queued, idle gaps, "
          "copies queued at once):")
    for ph in phases(copies(path)):
        span = max(c["land"] for c in ph) - min(c["start"] for c in ph)
        parts = []
        for d in ("gather", "scatter"):
            xs = [c for c in ph if c["dir"] == d]
            if not xs:
                continue
            busy, gaps, (a, b) = 0.0, [], (xs[0]["queued"], xs[0]["land"])
            for c in xs[1:]:
                if c["queued"] > b:
                    busy, gaps, (a, b) = busy + b - a, gaps + [c["queued"] - b], (c["queued"], c["land"])
                else:
                    b = max(b, c["land"])
            busy += b - a
            at_once = statistics.median(sum(1 for o in xs if o["start"] <= c["start"] < o["land"])
                                        for c in xs)
            parts.append(f"{d} n={len(xs)} {sum(c['mb'] for c in xs) / span / 1e3:.1f} GB/s "
                         f"queued {busy / span:.2f} gaps {len(gaps)} x "
                         f"{statistics.median(gaps) * 1e3 if gaps else 0:.2f} ms at once {at_once:g}")
        print(f"  {ph[0]['mb']:.0f} MB, {span * 1e3:.0f} ms: " + "; ".join(parts))


if __name__ == "__main__":
    summary(sys.argv[1])
    if "--phases" in sys.argv[2:]:
        occupancy(sys.argv[1])
