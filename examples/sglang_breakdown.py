"""Where one SGLang kvd hit's time goes: kvd's timeline (KVD_SGLANG_TRACE) cut at SGLang's calls.

``segments(lines, t_send, t_done, daemon_s)`` takes the timeline lines of
kvd's HiCache backend, radix cache or linker (kvd_client.sglang.timeline: one JSON line per call,
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

With SGLang's own request timestamps (``sglang``: the ``meta_info`` of an
engine run with ``enable_metrics``: ``forward_entry_time`` and
``prefill_finished_time``, wall-clock seconds, and ``queue_time``) and
``offset`` (the client's ``time.monotonic() - time.time()``), ``after`` is
split into ``to_forward`` (our last call returns → the request enters a
forward batch), ``prefill`` (that forward: the host-to-GPU load waited on
layer by layer, and the suffix) and ``reply`` (prefill done → first token
at the client); ``queue`` is SGLang's own waiting-queue time (it holds the
prefetch wait). Without them these are None.

The radix cache and the linker have no prefetch threads: for them ``exists`` is their
``lookup`` (at SGLang's prefix match) and ``get`` their loads. The radix cache's ``load``
holds the daemon's whole copy (SGLang waits for it before the forward); the linker's are
``submit_loads`` (queued on the forward's stream) and ``finish_loads`` (after that forward:
did every page land), so its forward, with the copy layer by layer inside, falls in
``between``.

Requests with no call in their window (a miss, no trace) give None.
"""

from __future__ import annotations

import json
from pathlib import Path

LOOKUPS = ("batch_exists", "lookup")                                # the backend; radix, linker
LOADS = ("batch_get_v1", "load", "submit_loads", "finish_loads")    # the backend; radix; linker
SEGMENTS = ("before", "exists", "between", "get", "kvd", "daemon", "after", "to_forward",
            "prefill", "reply", "queue", "total")


def read(path: Path) -> list[dict]:
    """The timeline's lines (a file that is absent: none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def segments(lines: list[dict], t_send: float, t_done: float, daemon_s: float,
             sglang: dict | None = None, offset: float = 0.0) -> dict | None:
    mine = sorted((x for x in lines if t_send <= x["t0"] <= t_done), key=lambda x: x["t0"])
    calls = [x for x in mine if x["op"] in LOOKUPS + LOADS]
    if not calls:
        return None

    def spent(*ops: str) -> float:
        return sum(x["t1"] - x["t0"] for x in mine if x["op"] in ops)

    before = calls[0]["t0"] - t_send
    after = t_done - max(x["t1"] for x in calls)
    total = t_done - t_send
    exists, get = spent(*LOOKUPS), spent(*LOADS)
    out = {"before": before, "exists": exists, "between": total - before - exists - get - after,
           "get": get, "kvd": spent("kvd_load"), "daemon": daemon_s, "after": after,
           "total": total, **_sglang_parts(sglang, offset, t_done - after, t_done)}
    return {k: None if v is None else round(v * 1e3, 3) for k, v in out.items()}


def _sglang_parts(sglang: dict | None, offset: float, last_call: float, t_done: float) -> dict:
    """``after`` cut at SGLang's forward entry and prefill end (monotonic via ``offset``)."""
    parts = dict.fromkeys(("to_forward", "prefill", "reply", "queue"))
    if not sglang or not sglang.get("forward_entry_time") or not sglang.get("prefill_finished_time"):
        return parts
    entry = sglang["forward_entry_time"] + offset
    done = sglang["prefill_finished_time"] + offset
    parts.update(to_forward=entry - last_call, prefill=done - entry, reply=t_done - done,
                 queue=sglang.get("queue_time"))
    return parts


def table(rows: dict) -> list[str]:
    """Printable lines: one per (prefix, engine) of median segments, ms."""
    out = [f"{'prefix':>8} {'engine':<16}" + "".join(f"{s:>11}" for s in SEGMENTS)]
    for n, per_engine in rows.items():
        for name, cuts in per_engine.items():
            cuts = [c for c in cuts if c]
            if not cuts:
                continue
            med = {s: _median([c.get(s) for c in cuts]) for s in SEGMENTS}
            out.append(f"{n:>8} {name:<16}" + "".join(
                f"{'-':>11}" if med[s] is None else f"{med[s]:>11.1f}" for s in SEGMENTS))
    return out


def _median(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None
