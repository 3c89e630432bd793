"""Prometheus metrics: ``/metrics`` on ``metrics_address:metrics_port`` and/or ``metrics_socket``.

``start(cfg, service, ...)`` serves the exposition (prometheus-client, kvd-cache's ``metrics`` extra;
missing library or unbindable address: start-up fails with one line) through
kvd.server.metrics_http on the event loop, bounded so no scraper can take the daemon's
descriptors or slow its engines. ``KvdCollector`` reads at render time the counters the
loop keeps anyway, through copies and ``len()``. Names follow Prometheus conventions
(``kvd_`` prefix, base units, ``_total``); docs/observe.md lists them.
"""

from __future__ import annotations

import logging
import resource
from functools import partial
from importlib import metadata
from pathlib import Path

from kvd.server.metrics_http import MetricsServer, tcp_listener, unix_listener
from kvd.server.stats import LATENCY_BUCKETS_S
from kvd_protocol import wire

log = logging.getLogger("kvd")

DISK_IO_ERRORS = ("enospc", "write_errors", "read_errors", "vanished")
DISK_COUNTERS = (  # (metric name, help, the disk tier's counter)
    ("kvd_disk_writes_total", "Chunk files written to the disk tier.", "writes"),
    ("kvd_disk_write_bytes_total", "Bytes written to the disk tier.", "write_bytes"),
    ("kvd_disk_reads_total", "Chunk files read from the disk tier.", "reads"),
    ("kvd_disk_read_bytes_total", "Bytes read from the disk tier.", "read_bytes"),
    ("kvd_demotions_dropped_total", "Demotions dropped because the write queue was full.",
     "demotions_dropped"),
    ("kvd_demotions_failed_total", "Demotions that failed (IO error, full disk).", "demotions_failed"),
    ("kvd_checksum_failures_total", "Disk chunks whose checksum did not match (dropped).",
     "checksum_failures"),
)
TIERING_COUNTERS = (
    ("kvd_demotions_total", "Chunks copied from the host tier to the disk tier.", "demotions"),
    ("kvd_promotions_total", "Chunks read from the disk tier back into the host tier.", "promotions"),
    ("kvd_promotions_failed_total", "Promotions that failed.", "promotions_failed"),
    ("kvd_demotions_skipped_cold_total", "Chunks not demoted for too few hits (disk_min_hits).",
     "demotions_skipped_cold"),
)
REMOTE_COUNTERS = (  # (metric name, help, key of the remote tier's stats)
    ("kvd_remote_gets_total", "Chunks fetched from the remote store.", "gets"),
    ("kvd_remote_get_bytes_total", "Bytes fetched from the remote store.", "get_bytes"),
    ("kvd_remote_puts_total", "Chunks sent to the remote store.", "puts"),
    ("kvd_remote_put_bytes_total", "Bytes sent to the remote store.", "put_bytes"),
    ("kvd_remote_puts_present_total", "Chunks not sent: the remote store had them already.",
     "puts_present"),
    ("kvd_remote_corrupt_total", "Remote values that failed verification (dropped, deleted).",
     "corrupt"),
    ("kvd_remote_promotions_total", "Chunks fetched from the remote store into the host tier.",
     "promotions"),
    ("kvd_remote_promotions_failed_total", "Remote fetches that brought nothing (missing, failed, "
     "corrupt, no room).", "promotions_failed"),
    ("kvd_remote_publish_dropped_total", "Chunks not queued for the remote store: queue full.",
     "publish_dropped"),
    ("kvd_remote_breaker_opened_total", "Times the remote store's circuit breaker opened.",
     "breaker_opened"),
    ("kvd_remote_zero_copy_puts_total", "Chunks sent from the host arena without a copy "
     "(the zero-copy path).", "zero_copy_puts"),
    ("kvd_remote_zero_copy_gets_total", "Chunks fetched straight into host slots (the "
     "zero-copy path).", "zero_copy_gets"),
    ("kvd_remote_digest_processes_lost_total", "Checksum processes dropped (died, hung or "
     "refused); their checksums run on the daemon's threads.", "digest_processes_lost"),
)
REMOTE_FAILURES = (("error", "errors"), ("timeout", "timeouts"), ("skipped", "skipped"),
                   ("busy", "busy"))
BREAKER_STATES = ("closed", "probing", "open")
GDS_COUNTERS = (
    ("kvd_gds_loads_total", "Loads served by GPU Direct Storage.", "direct_loads"),
    ("kvd_gds_loaded_chunks_total", "Chunks read by GPU Direct Storage into GPU pages.", "direct_chunks"),
    ("kvd_gds_loaded_bytes_total", "Bytes read by GPU Direct Storage into GPU pages.", "direct_bytes"),
    ("kvd_gds_fallbacks_total", "GPU Direct Storage loads finished through the host tier.", "fallbacks"),
)


def start(cfg, service, runtime_dir: Path, group: int | None, policy):
    """Serve /metrics when ``metrics_port`` or ``metrics_socket`` is set (on the running
    loop); returns the ``MetricsServer`` (``close()``) or None."""
    if not cfg.metrics_port and not cfg.metrics_socket:
        return None
    problem = library_problem(cfg)  # kvd.server.startup checked it before the allocation
    if problem:
        raise RuntimeError(problem)
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.process_collector import ProcessCollector
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(KvdCollector(service))
    listeners = bool(cfg.metrics_port) + bool(cfg.metrics_socket)
    server = MetricsServer(partial(generate_latest, registry),
                           connection_cap(cfg.metrics_max_connections, listeners),
                           cfg.metrics_timeout_s, service.stats)
    if cfg.metrics_port:
        server.listen(tcp_listener(cfg.metrics_address, cfg.metrics_port))
        log.info("metrics: http://%s:%d/metrics", cfg.metrics_address, cfg.metrics_port)
    if cfg.metrics_socket:
        path = runtime_dir / cfg.metrics_socket  # an absolute metrics_socket stays as it is
        try:
            server.listen(unix_listener(path, group), policy)
        except RuntimeError:
            server.close()
            raise
        log.info("metrics: unix socket %s (curl --unix-socket %s http://kvd/metrics)", path, path)
    return server


def library_problem(cfg) -> str | None:
    """Why /metrics, when configured, cannot be served for want of prometheus-client."""
    if not cfg.metrics_port and not cfg.metrics_socket:
        return None
    try:
        import prometheus_client  # noqa: F401 - imported, not just found: a broken one counts
    except ImportError:
        knob = "metrics_port" if cfg.metrics_port else "metrics_socket"
        return (f"{knob} is set but prometheus-client is not installed: pip install "
                f"prometheus-client (kvd-cache's metrics extra), or unset {knob}")
    return None


def connection_cap(wanted: int, listeners: int) -> int:
    """``metrics_max_connections`` (per listening socket), lowered so that all of them
    together hold at most a quarter of the open files limit: the rest is the engines', the
    disk tier's and libzmq's (which aborts when it cannot get one)."""
    most = max(1, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // (4 * listeners))
    if wanted > most:
        log.warning("metrics_max_connections = %d lowered to %d: a quarter of the open files "
                    "limit (ulimit -n, LimitNOFILE=)", wanted, most)
    return min(wanted, most)


class KvdCollector:
    """Builds every ``kvd_*`` family from the daemon's counters at scrape time."""

    def __init__(self, service):
        self.service = service

    def collect(self):
        from prometheus_client.core import InfoMetricFamily
        s = self.service
        info = InfoMetricFamily("kvd_build", "kvd version, wire protocol and copy backends.")
        info.add_metric([], {"version": _version(), "protocol": str(wire.VERSION),
                             "backends": s.backends})
        yield info
        scraped = s.stats.scrape()
        yield from _requests(scraped)
        yield from _cache(scraped, s)
        yield from _sessions(scraped["counters"], s.sessions)
        yield _counter("kvd_event_loop_cpu_seconds_total", "CPU time of the daemon's event loop "
                       "thread; a rate near 1 means requests and copies wait for the loop.",
                       scraped["loop_cpu_s"])
        yield _gauge("kvd_copies_queued", "Copies queued in the copy backends (on the GPUs) now.",
                     s.transfers.gate.total)
        if s.tiering is not None:
            yield from _disk(s.tiering)
        if s.gds is not None:
            yield from _counters(GDS_COUNTERS, dict(s.gds.counters))
        if s.remote is not None:
            yield from _remote(s.remote.stats())
        if s.tier.quota is not None:
            yield from _quotas(s.tier.quota.stats(), s.tiering is not None)


def _version() -> str:
    try:
        return metadata.version("kvd-cache")  # the distribution, not PyPI's unrelated "kvd"
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _counter(name: str, doc: str, value=None, labels=()):
    from prometheus_client.core import CounterMetricFamily
    return CounterMetricFamily(name.removesuffix("_total"), doc, value=value, labels=labels or None)


def _gauge(name: str, doc: str, value=None, labels=()):
    from prometheus_client.core import GaugeMetricFamily
    return GaugeMetricFamily(name, doc, value=value, labels=labels or None)


def _counters(table, values: dict):
    for name, doc, key in table:
        yield _counter(name, doc, values.get(key, 0))


def _requests(scraped: dict):
    from prometheus_client.core import HistogramMetricFamily
    hist = HistogramMetricFamily("kvd_request_duration_seconds", "Time from a request's parse to "
                                 "its reply, by op.", labels=["op"])
    requests = _counter("kvd_requests_total", "Requests answered, by op.", labels=["op"])
    for op, (counts, total) in sorted(scraped["histograms"].items()):
        cumulative, buckets = 0, []
        for bound, n in zip((*map(str, LATENCY_BUCKETS_S), "+Inf"), counts):
            cumulative += n
            buckets.append((bound, cumulative))
        hist.add_metric([op], buckets, total)
        requests.add_metric([op], cumulative)
    errors = _counter("kvd_request_errors_total", "Requests answered with an error, by op and "
                      "error code (deadline_exceeded: the client's timeout passed).", labels=["op", "code"])
    for (op, code), n in sorted(scraped["errors"].items()):
        errors.add_metric([op, code], n)
    yield from (hist, requests, errors)


def _cache(scraped: dict, s):
    c = scraped["counters"]
    hits = _counter("kvd_lookup_hit_chunks_total", "Chunks lookups found, by the tier that held "
                    "them.", labels=["tier"])
    hits.add_metric(["host"], c.get("hit_chunks", 0) - c.get("disk_hit_chunks", 0)
                    - c.get("remote_hit_chunks", 0))
    hits.add_metric(["disk"], c.get("disk_hit_chunks", 0))
    if s.remote is not None:
        hits.add_metric(["remote"], c.get("remote_hit_chunks", 0))
    yield hits
    yield _counter("kvd_lookup_miss_chunks_total", "Chunks lookups did not find.", c.get("miss_chunks", 0))
    yield _counter("kvd_store_dedup_chunks_total", "Chunks a store skipped: already cached.",
                   c.get("store_dedup", 0))
    yield _counter("kvd_foreign_ns_misses_total", "Lookups and loads that sent the key of a chunk "
                   "of another namespace or shard geometry (a miss from there on).",
                   c.get("foreign_ns_misses", 0))
    yield _counter("kvd_host_corrupt_dropped_total", "Host tier chunks a load found failing their "
                   "checksum (verify_loads = on): dropped, recomputed by the engine.",
                   c.get("host_corrupt_dropped", 0))
    backends = sorted({*s.backends.split(","), *(b for _, b in scraped["moved"])})
    for what in ("stored", "loaded"):
        for unit, doc in (("chunks", "Chunks"), ("bytes", "Bytes")):
            family = _counter(f"kvd_{what}_{unit}_total", f"{doc} engines {what} (one shard each), "
                              "by copy backend.", labels=["backend"])
            for backend in backends:  # every backend from the start: 0, not "no data"
                family.add_metric([backend], scraped["moved"].get((f"{unit}_{what}", backend), 0))
            yield family
    tier = s.tier
    cap = _gauge("kvd_tier_capacity_bytes", "Capacity of each tier.", labels=["tier"])
    used = _gauge("kvd_tier_used_bytes", "Bytes in use in each tier.", labels=["tier"])
    chunks = _gauge("kvd_tier_chunks", "Chunks held by each tier (host: including chunks being "
                    "stored).", labels=["tier"])
    evictions = _counter("kvd_evictions_total", "Chunks evicted from each tier.", labels=["tier"])
    cap.add_metric(["host"], tier.capacity)
    used.add_metric(["host"], tier.alloc.used)
    chunks.add_metric(["host"], len(tier.entries))
    evictions.add_metric(["host"], tier.evictions)
    if s.tiering is not None:
        disk = s.tiering.disk
        cap.add_metric(["disk"], disk.capacity)
        used.add_metric(["disk"], disk.used)
        chunks.add_metric(["disk"], len(disk.entries))
        evictions.add_metric(["disk"], dict(disk.counters).get("evictions", 0))
    yield from (cap, used, chunks, evictions)
    yield _counter("kvd_host_evicted_not_on_disk_total", "Host chunks evicted with no copy on disk "
                   "(lost from the cache).", tier.evicted_not_on_disk)
    if tier.journal is not None:  # warm restart (kvd/tiers/host/journal.py)
        w = dict(tier.journal.counters)
        yield _counter("kvd_host_checksum_failures_total", "Host chunks adopted after a crash whose "
                       "checksum did not match (dropped).", w.get("checksum_failures", 0))
        yield _gauge("kvd_host_verify_pending", "Host chunk shards adopted after a crash that wait "
                     "for their checksum check (no hits until then).", w.get("verify_pending", 0))
        yield _gauge("kvd_host_unsealed_shards", "Host chunk shards whose checksum (for the next "
                     "warm restart) is waiting or being computed.", tier.journal.unsealed)
        yield _counter("kvd_host_checksums_skipped_total", "Host chunk shards evicted before their "
                       "checksum's turn (never read).", w.get("checksums_skipped", 0))


def _sessions(c: dict, sessions):
    yield _gauge("kvd_clients", "Engine sessions connected.", len(sessions.by_peer))
    yield _gauge("kvd_registrations", "KV pools registered.", len(sessions.registrations))
    yield _gauge("kvd_leases", "Leases held on cached chunks.", len(sessions.leases))
    yield _counter("kvd_clients_reaped_total", "Sessions removed for silence or a re-hello.",
                   c.get("clients_reaped", 0))
    yield _counter("kvd_client_files_removed_total", "Shared-memory files of lost clients removed.",
                   c.get("client_files_removed", 0))
    yield _counter("kvd_connections_refused_total", "Connections refused by the peer credential "
                   "check.", c.get("connections_refused", 0))
    over = _counter("kvd_connections_over_cap_total", "Connections closed at once: their socket, "
                    "uid or process had its cap of connections.", labels=["socket"])
    open_ = _gauge("kvd_connections", "Connections open, by socket.", labels=["socket"])
    for name in ("engine", "control"):
        over.add_metric([name], c.get(f"connections_over_cap_{name}", 0))
        open_.add_metric([name], c.get(f"connections_{name}", 0))
    yield from (over, open_)


def _disk(tiering):
    c = dict(tiering.disk.counters)
    yield from _counters(DISK_COUNTERS, c)
    io = _counter("kvd_disk_io_errors_total", "Disk tier IO failures, by kind.", labels=["kind"])
    for kind in DISK_IO_ERRORS:
        io.add_metric([kind.removesuffix("_errors")], c.get(kind, 0))
    yield io
    yield _gauge("kvd_disk_queued_writes", "Demotions queued or being written.",
                 len(tiering.disk.writing))
    yield from _counters(TIERING_COUNTERS, dict(tiering.counters))


def _quotas(stats: dict, disk: bool):
    """Per quota group, labelled {model, tenant} ("*": any; "(other)": chunks no quota
    matches), so the series are the config's rules plus one."""
    labels = ["model", "tenant"]
    used = _gauge("kvd_quota_used_bytes", "Bytes of a quota group's chunks, by tier.",
                  labels=labels + ["tier"])
    limit = _gauge("kvd_quota_limit_bytes", "A quota group's configured limits (host_max, "
                   "host_reserve, disk_max; unset ones absent).", labels=labels + ["limit"])
    evictions = _counter("kvd_quota_evictions_total", "Chunks of a quota group evicted, by tier "
                         "(disk: deleted files).", labels=labels + ["tier"])
    refusals = _counter("kvd_quota_refusals_total", "Stores and promotions (host) or demotions "
                        "(disk) refused at a quota group's cap.", labels=labels + ["tier"])
    tiers = ("host", "disk") if disk else ("host",)
    for g in [*stats["groups"], stats["other"]]:
        group = [g["model"], g["tenant"]]
        for tier in tiers:
            used.add_metric(group + [tier], g[f"{tier}_used_bytes"])
            evictions.add_metric(group + [tier], g[f"{tier}_evictions"])
            refusals.add_metric(group + [tier], g[f"{tier}_refused"])
        for name in ("host_max", "host_reserve", "disk_max"):
            if g[f"{name}_bytes"]:
                limit.add_metric(group + [name], g[f"{name}_bytes"])
    yield from (used, limit, evictions, refusals)


def _remote(stats: dict):
    yield from _counters(REMOTE_COUNTERS, stats)
    failures = _counter("kvd_remote_failures_total", "Remote store calls that failed (error), "
                        "timed out (timeout), were refused by the open breaker (skipped) or "
                        "because every remote thread was busy (busy).", labels=["kind"])
    for kind, key in REMOTE_FAILURES:
        failures.add_metric([kind], stats[key])
    yield failures
    state = _gauge("kvd_remote_breaker_state", "The remote store's circuit breaker: 1 for its "
                   "current state (closed: in use; open: local-only; probing).", labels=["state"])
    for name in BREAKER_STATES:
        state.add_metric([name], int(stats["breaker"] == name))
    yield state
    yield _gauge("kvd_remote_queued_puts", "Chunks queued for the remote store or being put.",
                 stats["publish_queued"])
