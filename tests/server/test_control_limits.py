"""The control socket has per-peer caps: a peer that never reads costs itself, not the daemon.

A raw DEALER sends tens of thousands of ``stats`` requests to a real
daemon's control socket and never reads a reply, while another peer asks
for ``health`` over and over: the daemon's memory stays flat (its replies
to the slow reader queue up to a small bound, the rest are dropped and
counted), it logs a few lines about it rather than one per dropped reply,
and the other peer's ``health`` keeps answering within a fraction of a
second.
"""

from __future__ import annotations

import os
import threading
import time

import zmq
from daemons import status_kib

from kvd_client.transport import Channel
from kvd_protocol import wire
from kvd_protocol.runtime import control_endpoint

REQUESTS = 50_000


def flood(endpoint: str, n: int) -> zmq.Socket:
    """A DEALER that sent ``n`` stats requests (queued without limit on its side) and reads
    nothing; the caller closes it."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    for i in range(n):
        sock.send_multipart(wire.encode_request(i + 1, "stats"))
    return sock


def health_latencies(endpoint: str, stop: threading.Event, out: list) -> None:
    ch = Channel(endpoint, timeout=10.0)
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            ch.request("health")
            out.append(time.monotonic() - t0)
            time.sleep(0.05)
    finally:
        ch.close()


def test_a_peer_that_never_reads_its_replies_costs_itself_only(start_daemon):
    d = start_daemon()
    endpoint = control_endpoint(d.runtime_dir)
    pid = d.proc.pid
    rss0 = status_kib(pid, "VmRSS")
    lines0 = d.log().count("\n")
    latencies, stop = [], threading.Event()
    watcher = threading.Thread(target=health_latencies, args=(endpoint, stop, latencies))
    watcher.start()
    slow = flood(endpoint, REQUESTS)
    try:
        time.sleep(5.0)  # the daemon works through the flood meanwhile
        rss1 = status_kib(pid, "VmRSS")
    finally:
        stop.set()
        watcher.join()
        slow.close()
    stats = d.stats()
    assert d.proc.poll() is None
    assert rss1 - rss0 < 16 * 1024, f"grew {rss1 - rss0} KiB"
    assert max(latencies) < 0.5, sorted(latencies)[-5:]
    assert stats["busy"] + stats["replies_dropped"] > REQUESTS // 2, stats
    assert d.log().count("\n") - lines0 < 20, d.log()[-3000:]
    assert d.stop() == 0
