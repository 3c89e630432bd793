"""Prometheus /metrics of a real daemon: the counters move by exactly what engines did.

A spawned engine (tests/workers_ops.py) runs a known sequence of requests
while this process scrapes ``/metrics`` over HTTP, parsed with
prometheus-client's own exposition parser. Also: metrics off by default,
a clear start-up failure when the port cannot be served.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest
import workers_data as W
import workers_ops
from daemons import wait_for

from kvd.cli.format import format_stats
from kvd.server.metrics_http import RENDER_EVERY_S
from kvd_protocol import wire

parser = pytest.importorskip("prometheus_client.parser")

SPEC = {"layout": "vllm_flash_attn", "layers": 2, "page_size": 16, "dtype": "float16",
        "num_pages": 64, "heads": 2, "dim": 8}
SHARD = 2 * 2 * W.CHUNK * 2 * 8 * 2  # layers x planes x tokens x heads x dim x 2 bytes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    """{(sample name, sorted label items): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_move_by_exactly_what_the_engine_did(start_daemon, procs):
    import multiprocessing
    port = free_port()
    d = start_daemon(metrics_port=port)
    with multiprocessing.get_context("spawn").Manager() as m:
        connected, proceed = m.Event(), m.Event()
        job = procs.apply_async(workers_ops.metered_run,
                                (str(d.runtime_dir), SPEC, 7, 3, 2, connected, proceed))
        assert connected.wait(30), "the engine did not connect"
        before = scrape(port)
        assert value(before, "kvd_clients") == 1 and value(before, "kvd_registrations") == 1
        scrapes, stop = [], threading.Event()

        def scrape_meanwhile():  # scrapes racing the requests must neither fail nor go backwards
            while not stop.is_set():
                scrapes.append(scrape(port))

        scraper = threading.Thread(target=scrape_meanwhile)
        scraper.start()
        proceed.set()
        try:
            out = job.get(60)
        finally:
            stop.set()
            scraper.join()
    time.sleep(RENDER_EVERY_S)  # a scrape shows the counters as they were at most this long ago
    after = scrape(port)
    assert out == {"stored": 48, "restored": 48, "hits": 48, "other_hits": 0, "loaded": 48,
                   "bad_load": "out_of_range"}

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("kvd_stored_chunks_total", backend="host") == 3
    assert delta("kvd_stored_bytes_total", backend="host") == 3 * SHARD
    assert delta("kvd_loaded_chunks_total", backend="host") == 3
    assert delta("kvd_loaded_bytes_total", backend="host") == 3 * SHARD
    assert delta("kvd_store_dedup_chunks_total") == 3
    assert delta("kvd_lookup_hit_chunks_total", tier="host") == 3
    assert delta("kvd_lookup_hit_chunks_total", tier="disk") == 0
    assert delta("kvd_lookup_miss_chunks_total") == 2
    assert delta("kvd_request_errors_total", op="load", code="out_of_range") == 1
    for op, n in (("store", 2), ("lookup", 2), ("load", 2), ("bye", 1)):
        assert delta("kvd_requests_total", op=op) == n, op
        assert delta("kvd_request_duration_seconds_count", op=op) == n, op
        assert delta("kvd_request_duration_seconds_bucket", op=op, le="+Inf") == n, op
        assert delta("kvd_request_duration_seconds_sum", op=op) > 0, op
    assert value(after, "kvd_tier_chunks", tier="host") == 3
    assert 3 * SHARD <= value(after, "kvd_tier_used_bytes", tier="host") < 3 * (SHARD + 4096)
    assert value(after, "kvd_tier_capacity_bytes", tier="host") == 64 * 2**20
    assert value(after, "kvd_clients") == 0 and value(after, "kvd_registrations") == 0
    assert value(after, "kvd_build_info", version=_version(), protocol=str(wire.VERSION), backends="host") == 1
    assert value(after, "process_resident_memory_bytes") > 0
    assert delta("kvd_event_loop_cpu_seconds_total") > 0
    loop_cpu = [value(s, "kvd_event_loop_cpu_seconds_total") for s in scrapes]
    assert loop_cpu == sorted(loop_cpu), "the loop's CPU time went backwards between scrapes"
    stored = [value(s, "kvd_stored_chunks_total", backend="host") for s in scrapes]
    assert scrapes and stored == sorted(stored), "a counter went backwards between scrapes"
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in after.items()
                     if k[0] == "kvd_request_duration_seconds_bucket" and dict(k[1])["op"] == "store")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    assert buckets[0][0] == 50e-6 and buckets[-2][0] == 5.0
    # kvd stats splits the stores and loads that copied by phase; each phase within the whole
    st = d.stats()
    phases, whole = st["latency_phases"], st["latency"]
    assert set(phases) == {"store", "load"}, phases
    for op, split in phases.items():
        assert set(split) == {"turn", "engine", "copy"}, split
        assert all(0 <= v["p50_ms"] <= v["p99_ms"] <= whole[op]["p99_ms"] for v in split.values()), (op, split)
    text = format_stats(st)  # kvd stats, for people
    assert "  load p50: behind the engine's earlier requests " in text and "  store p50: " in text, text


def _version() -> str:
    import kvd
    return kvd.__version__


def test_loop_cpu_counts_the_event_loops_work_not_the_wall_clock(start_daemon, procs):
    """``loop_cpu_s`` in ``kvd stats`` is the event loop thread's CPU time: an idle second
    adds almost nothing (the loop sleeps in epoll), a client sending requests back to back
    adds its share of the loop's work, and never more than the wall time that passed."""
    import multiprocessing
    d = start_daemon()
    first = d.stats()["loop_cpu_s"]
    time.sleep(1.0)
    idle = d.stats()["loop_cpu_s"] - first
    assert 0 <= idle < 0.3, idle
    with multiprocessing.get_context("spawn").Manager() as m:
        stop = m.Event()
        job = procs.apply_async(workers_ops.busy_engine, (str(d.runtime_dir), SPEC, 5, stop))
        wait_for(lambda: d.stats()["chunks_stored"] >= 20, 60, "the busy engine's stores")
        t0, before = time.monotonic(), d.stats()["loop_cpu_s"]
        time.sleep(2.0)
        busy, wall = d.stats()["loop_cpu_s"] - before, time.monotonic() - t0
        stop.set()
        assert job.get(60)["rounds"] > 0
    assert max(0.1, 2 * idle) < busy <= wall + 0.05, (idle, busy, wall)


def test_metrics_are_off_by_default(daemon):
    assert "/metrics" not in daemon.log()  # (the config lines name the knobs)
    assert daemon.stats()["clients"] == 0


def test_a_port_in_use_fails_start_up_with_one_clear_line(start_daemon):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = start_daemon(metrics_port=port, wait=False)
        assert d.proc.wait(30) == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in d.log()


def test_without_prometheus_client_a_set_port_fails_start_up(start_daemon, tmp_path):
    # a module named prometheus_client that cannot be imported, first on the path
    (tmp_path / "prometheus_client").mkdir()
    (tmp_path / "prometheus_client" / "__init__.py").write_text("raise ImportError('hidden')\n")
    d = start_daemon(metrics_port=free_port(), wait=False,
                     wrapper=["env", f"PYTHONPATH={tmp_path}"])
    assert d.proc.wait(30) == 1
    assert "metrics_port is set but prometheus-client is not installed" in d.log()
    # before the host tier: under systemd's Restart=on-failure, a restart allocates nothing
    assert "allocating the host tier" not in d.log() and "Traceback" not in d.log()


def test_the_grafana_dashboard_uses_only_metrics_the_daemon_exports(start_daemon, tmp_path):
    import json
    import re
    from pathlib import Path

    from kvd.server.metrics import GDS_COUNTERS
    port = free_port()
    d = start_daemon(metrics_port=port, disk_dir=str(tmp_path / "disk"), disk_capacity="16MiB")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        families = list(parser.text_string_to_metric_families(reply.read().decode()))
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "info": ["_info"]}
    exported = {f.name + s for f in families for s in suffixes.get(f.type, [""])}
    exported |= {name for name, _, _ in GDS_COUNTERS}  # exported only with a GPU
    d.stop()
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "configs" / "grafana-kvd.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b((?:kvd|process)_[a-z_]+)\b", e)}
    assert len(exprs) > 20 and len(used) > 25
    assert used - exported == set(), "the dashboard queries metrics nobody exports"
    assert {"kvd_request_duration_seconds_bucket", "kvd_lookup_hit_chunks_total"} <= used


def test_warm_restart_metrics_count_a_chunk_that_failed_its_checksum(start_daemon):
    import test_warm_restart as WR
    d = start_daemon(**WR.KNOBS)
    rd = d.runtime_dir
    checker = WR.Checker(rd)
    try:
        assert checker.store(0) == WR.FULL
        bad = checker.client.keys(WR.W.tokens_of(0))[3]
    finally:
        checker.close()
    WR.sealed(d, WR.W.CHUNKS)
    d.kill()
    WR.flip_byte(rd, WR.record_offset(rd, bad))
    port = free_port()
    d = start_daemon(runtime_dir=rd, metrics_port=port, **WR.KNOBS)
    WR.verified(d)
    samples = scrape(port)
    assert value(samples, "kvd_host_checksum_failures_total") == 1
    assert value(samples, "kvd_host_verify_pending") == 0
