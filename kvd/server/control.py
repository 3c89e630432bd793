"""Operator commands on the control socket, over the service's state.

``handle(service, op)`` answers ``health`` (liveness, pid, backends,
uptime), ``stats`` (the snapshot documented in docs/protocol.md §6, with
each client's kernel-reported uid/gid/pid),
``clear`` (drop every host chunk nobody pins; with quotas, ``stats`` has
each group's bytes and counters), ``flush_disk`` (write every
host chunk to the disk tier and wait) and ``clear_disk`` (delete every disk
chunk nobody reads). The op is validated by the server (protocol.CONTROL_OPS).
"""

from __future__ import annotations

import os


async def handle(service, op: str) -> dict:
    if op == "health":
        return {"status": "ok", "pid": os.getpid(), "backend": service.backends,
                "uptime_s": service.stats.summary()["uptime_s"]}
    if op in ("flush_disk", "clear_disk"):
        return await _disk(service, op)
    if op == "clear":
        dropped, kept = service.tier.clear()
        return {"dropped": dropped, "kept_in_use": kept}
    return snapshot(service)


async def _disk(service, op: str) -> dict:
    if service.tiering is None:
        return {"disk": "off"}
    if op == "flush_disk":
        return {"written": await service.tiering.flush()}
    deleted, kept = await service.tiering.disk.clear()
    return {"deleted": deleted, "kept_in_use": kept}


def snapshot(service) -> dict:
    tiers = {"host": service.tier.stats()}
    if service.tiering is not None:
        tiers["disk"] = {**service.tiering.disk.stats(), **service.tiering.stats(),
                         "gds": None if service.gds is None else service.gds.stats()}
    if service.remote is not None:
        tiers["remote"] = service.remote.stats()
    sessions = service.sessions
    quotas = {} if service.tier.quota is None else {"quotas": service.tier.quota.stats()}
    return {"tiers": tiers, **quotas, "disk_hits": service.stats.counters["disk_hit_chunks"],
            "remote_hits": service.stats.counters["remote_hit_chunks"],
            **service.stats.summary(),
            "latency": service.stats.latency_ms(), "latency_phases": service.stats.phases_ms(),
            "latency_histogram": service.stats.latency_histogram(),
            "clients": len(sessions),
            "sessions": [_session(s, service.transfers.gate) for s in sessions.by_peer.values()],
            "copies_queued": service.transfers.gate.total,
            "connections_refused": service.stats.counters["connections_refused"],
            "connections": _connections(service.stats.counters),
            "metrics": _metrics(service.stats.counters),
            "registrations": len(sessions.registrations), "leases": len(sessions.leases),
            "backend": service.backends, "chunk_tokens": service.cfg.chunk_tokens}


def _metrics(c) -> dict:
    """What the /metrics endpoint turned away (kvd.server.metrics_http)."""
    return {"refused": c["metrics_refused"], "timeouts": c["metrics_timeouts"],
            "bad_requests": c["metrics_bad_requests"], "accept_failed": c["metrics_accept_failed"]}


def _connections(c) -> dict:
    """Connections open per socket, and those closed at once for a cap (kvd.server.connections)."""
    return {"engine": c["connections_engine"], "control": c["connections_control"],
            "over_cap": c["connections_over_cap"]}


def _session(s, gate) -> dict:
    """A client as ``kvd stats`` shows it: its own name and pid, and what the kernel says."""
    cred = {} if s.cred is None else {"uid": s.cred.uid, "gid": s.cred.gid, "peer_pid": s.cred.pid}
    return {"name": s.name, "pid": s.pid, **cred, "registrations": len(s.registrations),
            "leases": len(s.leases), "copies_queued": gate.queued_by(s)}
