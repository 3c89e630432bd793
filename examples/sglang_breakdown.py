"""Where one SGLang kvd hit's time goes: kvd's timeline (KVD_SGLANG_TRACE) cut at SGLang's calls.

``segments(lines, t_send, t_done, daemon_s)`` takes the timeline lines of
kvd's HiCache backend (kvd_client.sglang.timeline: one JSON line per call,
CLOCK_MONOTONIC ``t0``/``t1``) that started while one request ran (sent at
``t_send``, first token at ``t_done``, both ``time.monotonic()`` of the
client) and the daemon's own seconds on the request's loads, and partitions
the request's time (ms):

- ``before``: request sent → SGLang's prefetch thread calls ``batch_exists``
  (tokenizer, scheduler, prefix match, prefetch queue, the thread's wake-up);
- ``exists``: inside ``batch_exists`` (ours: keys and the kvd lookups);
- ``between``: SGLang's hand-offs between our calls (hit count to the
  scheduler, host slots allocated, the IO thread's wake-up, per batch);
- ``get``: inside ``batch_get_v1`` (ours), of it ``kvd`` in kvd requests
  (round trips, wake-ups and the daemon's copy) and ``daemon`` the daemon's
  own time on them; ``get - kvd`` is the backend's own work (keys, copies);
- ``after``: our last call returns → first token (SGLang: completion seen by
  the scheduler, host-to-GPU load, the suffix's forward, the reply).

Requests with no backend call in their window (a miss, no trace) give None.
"""

from __future__ import annotations

import json
from pathlib import Path

SEGMENTS = ("before", "exists", "between", "get", "kvd", "daemon", "after", "total")


def read(path: Path) -> list[dict]:
    """The timeline's lines (a file that is absent: none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def segments(lines: list[dict], t_send: float, t_done: float, daemon_s: float) -> dict | None:
    mine = sorted((x for x in lines if t_send <= x["t0"] <= t_done), key=lambda x: x["t0"])
    calls = [x for x in mine if x["op"] in ("batch_exists", "batch_get_v1")]
    if not calls:
        return None

    def spent(op: str) -> float:
        return sum(x["t1"] - x["t0"] for x in mine if x["op"] == op)

    before = calls[0]["t0"] - t_send
    after = t_done - max(x["t1"] for x in calls)
    total = t_done - t_send
    exists, get = spent("batch_exists"), spent("batch_get_v1")
    out = {"before": before, "exists": exists, "between": total - before - exists - get - after,
           "get": get, "kvd": spent("kvd_load"), "daemon": daemon_s, "after": after,
           "total": total}
    return {k: round(v * 1e3, 3) for k, v in out.items()}


def table(rows: dict) -> list[str]:
    """Printable lines: one per (prefix, engine) of median segments, ms."""
    out = [f"{'prefix':>8} {'engine':<16}" + "".join(f"{s:>9}" for s in SEGMENTS)]
    for n, per_engine in rows.items():
        for name, cuts in per_engine.items():
            cuts = [c for c in cuts if c]
            if not cuts:
                continue
            med = {s: sorted(c[s] for c in cuts)[len(cuts) // 2] for s in SEGMENTS}
            out.append(f"{n:>8} {name:<16}" + "".join(f"{med[s]:>9.1f}" for s in SEGMENTS))
    return out
