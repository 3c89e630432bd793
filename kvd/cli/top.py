"""``kvd top``: a live view of one daemon, refreshed every ``--interval`` seconds.

Polls ``stats`` and shows what changed between polls: hit rate, GB/s in and out, requests
per second and latency percentiles per op (from histogram deltas, as Prometheus'
``histogram_quantile``), errors, event-loop busy share, tier fill, connected clients (names
through ``kvd.printable``, never read as markup). With ``rich`` (kvd-cache's ``top`` extra)
on a terminal it redraws in place; otherwise, and with ``--once``, plain text blocks.
"""

from __future__ import annotations

import sys
import time

from kvd.printable import printable
from kvd_client.transport import Channel
from kvd_protocol.errors import KvdError
from kvd_protocol.runtime import control_endpoint, resolve_runtime_dir

OPS = ("lookup", "store", "load")


def add_arguments(p) -> None:
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one plain-text view over one "
                   "interval and exit")


def run(args) -> int:
    channel = Channel(control_endpoint(resolve_runtime_dir(args.runtime_dir)), args.timeout)
    live = None
    try:
        health = channel.request("health")
        prev, t_prev = channel.request("stats"), time.monotonic()
        live = _live() if sys.stdout.isatty() and not args.once else None
        if sys.stdout.isatty() and not args.once and live is None:  # else it scrolls unexplained
            print("kvd top: rich is not installed: plain text, one view per refresh (pip install "
                  "rich for the live view)", file=sys.stderr, flush=True)
        while True:
            time.sleep(args.interval)
            cur, t_cur = channel.request("stats"), time.monotonic()
            view = compute(prev, cur, t_cur - t_prev, health)
            if live is None:
                print(render_text(view), flush=True)
            else:
                live.update(render_rich(view), refresh=True)
            if args.once:
                return 0
            prev, t_prev = cur, t_cur
    except KvdError as exc:
        print(f"kvd top: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if live is not None:
            live.stop()  # gives the terminal its screen back
        channel.close()


def _live():
    try:
        from rich.live import Live
    except ImportError:
        return None
    live = Live(auto_refresh=False, screen=True)
    live.start()
    return live


def quantile(bounds: list, counts: list, q: float) -> float | None:
    """The q-quantile (seconds) of bucket counts (not cumulative; the last is +Inf)."""
    total = sum(counts)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(bounds):  # in +Inf: the largest finite bound is all we know
                return bounds[-1]
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * (rank - seen) / n
        seen += n
    return bounds[-1]


def compute(prev: dict, cur: dict, dt: float, health: dict) -> dict:
    """What changed between two ``stats`` snapshots ``dt`` seconds apart."""
    hits, misses = cur["hits"] - prev["hits"], cur["misses"] - prev["misses"]
    hist = cur.get("latency_histogram", {"bounds_s": [], "counts": {}})
    old = prev.get("latency_histogram", {"counts": {}})["counts"]
    ops = {}
    for op in (*OPS, *sorted(set(hist["counts"]) - set(OPS))):
        counts = hist["counts"].get(op)
        if counts is None:
            continue
        delta = [a - b for a, b in zip(counts, old.get(op, [0] * len(counts)))]
        if op not in OPS and not any(delta):
            continue  # other ops only while they happen
        p50, p99 = (quantile(hist["bounds_s"], delta, q) for q in (0.5, 0.99))
        ops[op] = {"rate": sum(delta) / dt, "p50_ms": p50 and p50 * 1e3, "p99_ms": p99 and p99 * 1e3}
    return {"pid": health.get("pid"), "uptime_s": cur["uptime_s"], "backend": cur["backend"],
            "interval_s": dt, "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "bytes_in_per_s": (cur["bytes_stored"] - prev["bytes_stored"]) / dt,
            "bytes_out_per_s": (cur["bytes_loaded"] - prev["bytes_loaded"]) / dt,
            "errors_per_s": (cur["errors"] - prev["errors"]) / dt, "ops": ops,
            "loop_busy": (cur["loop_cpu_s"] - prev["loop_cpu_s"]) / dt
            if "loop_cpu_s" in cur and "loop_cpu_s" in prev else None,  # older daemons: -
            "tiers": {name: (t["used_bytes"], t["capacity_bytes"], t["chunks"])
                      for name, t in cur["tiers"].items()},
            "sessions": cur.get("sessions", []), "clients": cur["clients"]}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _throughput(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.2f} {unit}"
    return f"{bytes_per_s / 1e3:.2f} kB/s"


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _rows(view: dict) -> dict:
    """The view's tables as rows of strings, shared by both renderers."""
    ops = [[op, f"{o['rate']:.1f}", _ms(o["p50_ms"]), _ms(o["p99_ms"])] for op, o in view["ops"].items()]
    tiers = [[name, f"{_size(used)} / {_size(cap)}", f"{used / cap:.1%}" if cap else "-", str(chunks)]
             for name, (used, cap, chunks) in view["tiers"].items()]
    clients = [[printable(s["name"]), str(s["pid"]), str(s.get("uid", "?")), str(s.get("gid", "?")),
                str(s["registrations"]), str(s["leases"])] for s in view["sessions"]]
    rate = "-" if view["hit_rate"] is None else f"{view['hit_rate']:.1%}"
    head = (f"kvd top  pid {view['pid']}  up {view['uptime_s']:.0f} s  backend {view['backend']}  "
            f"interval {view['interval_s']:.1f} s")
    summary = (f"hit rate {rate} ({view['hits']} hits, {view['misses']} misses)  "
               f"in {_throughput(view['bytes_in_per_s'])}  out {_throughput(view['bytes_out_per_s'])}  "
               f"errors {view['errors_per_s']:.1f}/s  clients {view['clients']}  "
               f"loop {'-' if view['loop_busy'] is None else format(view['loop_busy'], '.0%')}")
    return {"head": head, "summary": summary, "ops": ops, "tiers": tiers, "clients": clients}


HEADERS = {"ops": ["op", "req/s", "p50 ms", "p99 ms"], "tiers": ["tier", "used / capacity", "fill", "chunks"],
           "clients": ["client", "pid", "uid", "gid", "pools", "leases"]}


def render_text(view: dict) -> str:
    rows = _rows(view)
    lines = [rows["head"], rows["summary"]]
    for name, header in HEADERS.items():
        table = [header, *rows[name]]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        lines.append("")
        lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                            enumerate(zip(r, widths))) for r in table]
    return "\n".join(lines) + "\n"


def render_rich(view: dict):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text  # plain text: a client's name is never read as rich markup
    rows = _rows(view)
    tables = []
    for name, header in HEADERS.items():
        table = Table(title=name, title_justify="left")
        for i, column in enumerate(header):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in rows[name]:
            table.add_row(*(Text(cell) for cell in row))
        tables.append(table)
    return Group(f"[bold]{rows['head']}[/bold]", rows["summary"], *tables)
