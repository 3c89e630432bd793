#!/usr/bin/env python3
"""Medians of the daemon's per-copy debug timings, next to a bench run.

    python3 -m kvd bench --gpu --daemon-log /tmp/kvd-debug.log
    python3 tools/daemon_timings.py /tmp/kvd-debug.log [--phases]

kvd.cuda.backend logs, per copy, how long queuing took and when the copy
landed; kvd.server.transfers logs the time spent in the service around each copy, and
when each request got its registration's turn, the engine's mark, the copy gate
and had its copy queued (medians per op).

``--phases`` also splits the log into phases (one direction, or both
mixed; see ``phases``) and prints per phase and direction:
GB/s over the phase, the fraction of the phase during which a copy of that
direction was queued on the GPU (from the end of its enqueue to its
landing), the idle gaps between copies, and how many copies of that
direction were queued at once (median at each copy's start). A direction
that idles between copies while the daemon queues the next is host-bound.
Where the copy lines carry ``began`` (monotonic, as the request lines), the
gaps are exact and split by how many requests of that direction were in
the daemon meanwhile (``in daemon N: ms``): gaps with none are the
clients', gaps with some are the daemon's (waiting for the engine's mark,
its turn, the copy gate or the load window, or queuing). Where they carry
``on the GPU`` (DMA copies), the phase line adds the median copy's time on
the GPU, from when its stream reached it to its end, and the GB/s of that:
a copy slow on the GPU is the copy engines' (for a load queued in steps,
with the host's waits between its steps), not a wait in the queue.
"""

import re
import statistics
import sys
from collections import defaultdict
from datetime import datetime

COPY_RE = re.compile(r"^(\S+ \S+) \S+ DEBUG (gather|scatter) of \d+ chunks, ([\d.]+) MB, (.*?): "
                     r"enqueued in ([\d.]+) ms, landed after ([\d.]+) ms(?:.*began ([\d.]+))?")
GPU_RE = re.compile(r"on the GPU ([\d.]+) ms")
STAMP_RE = re.compile(r"(turn|mark|gate|queued) \+([\d.]+)")
REQUEST_RE = re.compile(r"DEBUG request (store|load): received ([\d.]+), started [\d.]+, "
                        r"replied ([\d.]+)")


def summary(path):
    """Medians per (direction, MB) of the daemon's debug timings."""
    copy_re = re.compile(r"(gather|scatter) of \d+ chunks, ([\d.]+) MB, .*enqueued in ([\d.]+) ms, "
                         r"landed after ([\d.]+) ms")
    svc_re = re.compile(r"(store|load) of (\d+) chunks: ([\d.]+) ms in the service, ([\d.]+) ms")
    rows = defaultdict(list)
    svc = defaultdict(list)
    stamps = defaultdict(list)
    for line in open(path, errors="replace"):
        m = copy_re.search(line)
        if m:
            rows[m[1], m[2]].append((float(m[3]), float(m[4])))
        m = svc_re.search(line)
        if m:
            svc[m[1]].append((float(m[3]), float(m[4])))
            for name, ms in STAMP_RE.findall(line):
                stamps[m[1], name].append(float(ms))
    print("daemon-side medians (all shapes/pages mixed per MB):")
    for (what, mb), v in sorted(rows.items()):
        print(f"  {what:8} {mb:>7} MB  n={len(v):4}  enqueue {statistics.median(x for x, _ in v):.3f} ms"
              f"  landed {statistics.median(y for _, y in v):.3f} ms")
    for op, v in sorted(svc.items()):
        print(f"  {op:8} service {statistics.median(x for x, _ in v):.3f} ms, awaiting the copy "
              f"{statistics.median(y for _, y in v):.3f} ms (n={len(v)})")
        marks = [f"{name} +{statistics.median(stamps[op, name]):.3f}"
                 for name in ("turn", "mark", "gate", "queued") if stamps[op, name]]
        if marks:
            print(f"  {op:8} median ms after reaching the service: " + ", ".join(marks))


def copies(path):
    """Each logged copy: direction, MB, start, end of its enqueue, landing (seconds)."""
    out = []
    for line in open(path, errors="replace"):
        m = COPY_RE.match(line)
        if m:  # "began": CLOCK_MONOTONIC, µs; else the log line's wall clock, ms
            land = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if m[7]:
                land = float(m[7]) + float(m[6]) / 1e3
            start = land - float(m[6]) / 1e3
            gpu = GPU_RE.search(line)
            out.append({"dir": m[2], "mb": float(m[3]), "start": start,
                        "queued": start + float(m[5]) / 1e3, "land": land,
                        "gpu_ms": float(gpu[1]) if gpu else None})
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


def requests(path):
    """(op, received, replied) of each logged request, CLOCK_MONOTONIC seconds."""
    out = []
    for line in open(path, errors="replace"):
        m = REQUEST_RE.search(line)
        if m:
            out.append((m[1], float(m[2]), float(m[3])))
    return out


def _waits(gaps: list, reqs: list, op: str) -> str:
    """Gap time by the number of ``op`` requests in the daemon at each gap's middle."""
    by = defaultdict(float)
    for a, b in gaps:
        mid = (a + b) / 2
        by[sum(1 for o, r, d in reqs if o == op and r <= mid < d)] += b - a
    return " in daemon " + " ".join(f"{n}: {ms * 1e3:.1f} ms" for n, ms in sorted(by.items()))


def _on_gpu(xs: list) -> str:
    """The median copy's time on the GPU and the GB/s of that (where the log has it)."""
    ms = [c["gpu_ms"] for c in xs if c["gpu_ms"] is not None]
    if not ms:
        return ""
    mid = statistics.median(ms)
    return f" on the GPU {mid:.2f} ms ({statistics.median(c['mb'] for c in xs) / mid:.1f} GB/s)"


def occupancy(path):
    print("phases (per direction: GB/s, fraction of the phase with a copy queued, idle gaps, "
          "copies queued at once):")
    cs = copies(path)
    exact = bool(cs) and cs[0]["start"] < 1e9  # monotonic stamps, not the wall clock
    reqs = requests(path) if exact else []
    for ph in phases(cs):
        span = max(c["land"] for c in ph) - min(c["start"] for c in ph)
        parts = []
        for d in ("gather", "scatter"):
            xs = [c for c in ph if c["dir"] == d]
            if not xs:
                continue
            busy, gaps, (a, b) = 0.0, [], (xs[0]["queued"], xs[0]["land"])
            for c in xs[1:]:
                if c["queued"] > b:
                    busy, gaps, (a, b) = busy + b - a, gaps + [(b, c["queued"])], (c["queued"], c["land"])
                else:
                    b = max(b, c["land"])
            busy += b - a
            at_once = statistics.median(sum(1 for o in xs if o["start"] <= c["start"] < o["land"])
                                        for c in xs)
            lengths = [y - x for x, y in gaps]
            parts.append(f"{d} n={len(xs)} {sum(c['mb'] for c in xs) / span / 1e3:.1f} GB/s "
                         f"queued {busy / span:.2f} gaps {len(gaps)} x "
                         f"{statistics.median(lengths) * 1e3 if gaps else 0:.2f} ms at once {at_once:g}"
                         + _on_gpu(xs)
                         + (_waits(gaps, reqs, "store" if d == "gather" else "load") if reqs else ""))
        print(f"  {ph[0]['mb']:.0f} MB, {span * 1e3:.0f} ms: " + "; ".join(parts))


if __name__ == "__main__":
    summary(sys.argv[1])
    if "--phases" in sys.argv[2:]:
        occupancy(sys.argv[1])
