"""How operator commands print the daemon's replies for people.

``format_stats(snapshot)`` is ``kvd stats``'s table; ``summary(op, reply)``
is the one line ``kvd health`` and ``kvd ctl ...`` print (``--json`` prints
the reply itself instead). Replies are the control socket's (docs/protocol.md);
a client's name is printed through ``kvd.printable`` (escaped, bounded).
"""

from __future__ import annotations

import json

from kvd.printable import printable


def summary(op: str, r: dict) -> str:
    """One line saying what ``op`` did, from its reply ``r``."""
    if op == "health":
        return f"ok: pid {r['pid']}, backend {r['backend']}, up {r['uptime_s']} s"
    if r.get("disk") == "off":
        return f"{op.replace('_', '-')}: nothing to do: the daemon has no disk tier (disk_dir is not set)"
    if op == "clear":
        return f"clear: dropped {r['dropped']} host-tier chunks, kept {r['kept_in_use']} in use"
    if op == "flush_disk":
        return (f"flush-disk: wrote {r['written']} chunks to the disk tier; its write queue "
                "is empty")
    if op == "clear_disk":
        return f"clear-disk: deleted {r['deleted']} disk-tier chunks, kept {r['kept_in_use']} being read"
    return json.dumps(r, default=_hex)


def to_json(r, indent: int | None = 2) -> str:
    return json.dumps(r, indent=indent, default=_hex)


def _hex(b: bytes) -> str:
    return b.hex()


def format_stats(s: dict) -> str:
    lines = [f"{'tier':<8}{'capacity':>14}{'used':>14}{'chunks':>10}{'evictions':>11}"]
    for name, t in s["tiers"].items():
        if "capacity_bytes" not in t:  # the remote tier: a line of its own below
            continue
        lines.append(f"{name:<8}{size(t['capacity_bytes']):>14}{size(t['used_bytes']):>14}"
                     f"{t['chunks']:>10}{t['evictions']:>11}")
    warm = s["tiers"]["host"].get("warm")
    if warm and warm["start"] != "new":
        how = "a clean stop" if warm["start"] == "clean" else "a crash"
        lines.append(f"host: adopted {warm['adopted_chunks']} chunks after {how}  verification "
                     f"{warm['verify']} ({warm['verified_shards']} shards good, "
                     f"{warm['verify_pending']} pending, {warm['checksum_failures']} checksum "
                     f"failures)")
    disk = s["tiers"].get("disk")
    if disk:
        lines.append(f"disk: demotions {disk['demotions']} (dropped {disk['demotions_dropped']}, "
                     f"failed {disk['demotions_failed']})  promotions {disk['promotions']}  "
                     f"write {disk['write_gbps']} GB/s  read {disk['read_gbps']} GB/s  "
                     f"checksum failures {disk['checksum_failures']}  io errors {disk['io_errors']}  "
                     f"recovery {_recovery(disk['recovery'])}")
        gds = disk.get("gds")
        if gds:
            lines.append(f"gds: {gds['mode']}  loads {gds['direct_loads']}  chunks "
                         f"{gds['direct_chunks']} ({size(gds['direct_bytes'])})  fallbacks "
                         f"{gds['fallbacks']}")
    remote = s["tiers"].get("remote")
    if remote:
        lines.append(_remote(remote, s.get("remote_hits", 0)))
    quotas = s.get("quotas")
    for g in [*quotas["groups"], quotas["other"]] if quotas else ():
        lines.append(_quota(g, disk is not None))
    lines.append("")
    foreign = s.get("foreign_ns_misses", 0)  # shown once there are any: worth a look
    lines.append(f"hits {s['hits']}  misses {s['misses']}  hit rate {s['hit_rate']:.1%}  "
                 f"dedup {s['store_dedup']}"
                 + (f"  other-namespace keys {foreign}" if foreign else ""))
    corrupt = s.get("host_corrupt_dropped", 0)  # verify_loads: shown once there are any
    lines.append(f"stored {size(s['bytes_stored'])} ({s['chunks_stored']} chunks)  "
                 f"loaded {size(s['bytes_loaded'])} ({s['chunks_loaded']} chunks)"
                 + (f"  corrupt host chunks dropped {corrupt}" if corrupt else ""))
    lines.append(f"clients {s['clients']}  registrations {s['registrations']}  leases {s['leases']}  "
                 f"errors {s['errors']}  uptime {s['uptime_s']} s  backend {s['backend']}")
    for c in s.get("sessions", []):
        cred = f", uid {c['uid']} gid {c['gid']}" if "uid" in c else ""
        queued = f", {c['copies_queued']} copies queued" if c.get("copies_queued") else ""
        lines.append(f"  {printable(c['name'])}: pid {c['pid']}{cred}{queued}")
    if s["latency"]:
        lines.append("")
        lines.append(f"{'op':<12}{'count':>10}{'p50 ms':>10}{'p99 ms':>10}")
        for op, lat in sorted(s["latency"].items()):
            lines.append(f"{op:<12}{lat['count']:>10}{lat['p50_ms']:>10.3f}{lat['p99_ms']:>10.3f}")
        for op, split in sorted(s.get("latency_phases", {}).items()):  # where a store's or load's time went
            lines.append(f"  {op} p50: " + ", ".join(f"{PHASES[p]} {split[p]['p50_ms']:.3f} ms"
                                                     for p in PHASES if p in split))
    return "\n".join(lines)


PHASES = {"turn": "behind the engine's earlier requests", "engine": "waiting for the engine's stream",
          "copy": "copying"}


def _remote(r: dict, hits: int) -> str:
    keyed = " (keyed)" if r.get("keyed") else ""
    keyed += " zero-copy" if r.get("zero_copy") else ""
    if r.get("digest_processes") or r.get("digest_processes_lost"):
        keyed += f", checksums in {r['digest_processes']} processes ({r['digest_processes_lost']} lost)"
    return (f"remote: {r['backend']} {r['address']} prefix {r['prefix']}{keyed}  breaker {r['breaker']} "
            f"(opened {r['breaker_opened']})  hits {hits}  fetched {r['gets']} "
            f"({size(r['get_bytes'])})  sent {r['puts']} ({size(r['put_bytes'])}, "
            f"{r['puts_present']} already there)  queued {r['publish_queued']} (dropped "
            f"{r['publish_dropped']})  corrupt {r['corrupt']}  errors {r['errors']}  timeouts "
            f"{r['timeouts']}  skipped {r['skipped']}")


def _quota(g: dict, disk: bool) -> str:
    """A quota group's line: its bytes against its limits, evictions, refusals."""
    def tier(name: str) -> str:
        cap = g[f"{name}_max_bytes"]
        reserve = g.get(f"{name}_reserve_bytes")
        return (f"{name} {size(g[f'{name}_used_bytes'])}" + (f" of {size(cap)}" if cap else "")
                + (f" (reserve {size(reserve)})" if reserve else "")
                + f", {g[f'{name}_evictions']} evicted, {g[f'{name}_refused']} refused")
    return f"quota {g['model']} / {g['tenant']}: " + "; ".join(
        tier(name) for name in (("host", "disk") if disk else ("host",)))


def _recovery(rec: dict) -> str:
    scanned, total = rec.get("files_scanned"), rec.get("files_total")
    files = f", {scanned} of {total} files" if total else ""
    return f"{rec['state']} ({rec['chunks']} chunks{files})"


def size(n: float) -> str:
    """Bytes for people: '512 B', '1.5 KiB', '64.0 MiB'."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"
