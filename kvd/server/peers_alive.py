"""Which clients are still there, and replies to clients that are slow to read.

``Liveness(daemon)`` reaps: it expires leases and sessions silent for ``client_timeout_s``
with nothing in flight, and sooner when a connection closed (``connection_closed``, from
kvd.server.connections: a probe per session finds the gone one). ``Intake`` admits requests
per peer before any task is made: past ``max_inflight`` (engines) or ``CONTROL_INFLIGHT``
(control; its ``busy`` replies through kvd.server.backlog) a request gets ``busy`` at once.
``reply(sock, peer, frames, stats)`` retries a slow reader for ``REPLY_PATIENCE_S`` before
dropping (``replies_dropped``, logged at most once per peer per ``LOG_EVERY_S``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time

import zmq

from kvd_protocol import wire

log = logging.getLogger("kvd")
PROBE = wire.pack({"v": wire.VERSION, "id": 0, "result": {}})
PROBE_DELAY_S = 0.25
REPLY_PATIENCE_S = 5.0
LOG_EVERY_S = 60.0


class PeerLog:
    """At most one line per peer per ``every`` seconds, saying how many were held back since
    (bounded: past ``most`` peers the table starts afresh)."""

    def __init__(self, every: float = LOG_EVERY_S, most: int = 4096):
        self.every, self.most = every, most
        self.peers: dict[bytes, list] = {}  # peer -> [when it last got a line, lines held back]

    def due(self, peer: bytes) -> int | None:
        """The lines held back for ``peer`` when one may be logged now, else None."""
        now = time.monotonic()
        seen = self.peers.get(peer)
        if seen is not None and now - seen[0] < self.every:
            seen[1] += 1
            return None
        if seen is None and len(self.peers) >= self.most:
            self.peers.clear()
        self.peers[peer] = [now, 0]
        return 0 if seen is None else seen[1]


DROPPED = PeerLog()  # replies dropped for a full queue, per peer


async def reply(sock, peer: bytes, frames: list, stats) -> None:
    give_up, pause = time.monotonic() + REPLY_PATIENCE_S, 0.001
    while True:
        try:
            await sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            if time.monotonic() > give_up:
                stats.add("replies_dropped")
                held = DROPPED.due(peer)
                if held is not None:
                    log.warning("a reply was dropped: the client has not read its replies for "
                                "%.0f s (%d more dropped for it since the last such line)",
                                REPLY_PATIENCE_S, held)
                return
            await asyncio.sleep(pause)  # backing off: a flood of such waits must not spin the loop
            pause = min(pause * 2, 0.05)
        except zmq.ZMQError as exc:
            log.debug("reply to a gone peer dropped: %s", exc)
            return


class Liveness:
    def __init__(self, daemon):
        self.d = daemon
        self.probe_due: float | None = None

    async def reap_loop(self) -> None:
        d, cfg = self.d, self.d.cfg
        period = min(1.0, cfg.heartbeat_interval_s / 2)
        peer_log = d.service.peer_log
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if now - peer_log.summarized >= peer_log.interval_s:
                peer_log.summary(log)  # what peers' floods of log lines held back
            d.service.expire(now)
            gone = []
            if self.probe_due is not None and now >= self.probe_due:
                self.probe_due = None
                gone = await self._probe_peers()
            stale = d.service.sessions.stale(cfg.client_timeout_s, now)
            for session, why in [*((s, "connection closed") for s in gone),
                                 *((s, "heartbeat timeout") for s in stale if s not in gone)]:
                d.spawn(d.service.reap(session, why))

    async def _probe_peers(self) -> list:
        """Sessions whose routing id has no connection any more (ROUTER_MANDATORY)."""
        gone = []
        for session in list(self.d.service.sessions.by_peer.values()):
            if session.closing:
                continue
            try:
                await self.d.engine_sock.send_multipart([session.peer, PROBE], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # its queue is full: it is there
            except zmq.ZMQError as exc:
                if exc.errno == errno.EHOSTUNREACH:
                    gone.append(session)
        return gone

    def connection_closed(self) -> None:
        """A connection to the engine socket closed (kvd.server.connections): probe soon."""
        self.probe_due = time.monotonic() + PROBE_DELAY_S


class Intake:
    def __init__(self, sock, max_inflight: int, stats, cap: str = "max_inflight", backlog=None):
        self.sock, self.max_inflight, self.stats = sock, max_inflight, stats
        self.cap = cap  # what the busy reply names as the limit
        self.backlog = backlog  # kvd.server.backlog.Backlog: busy replies wait there for room
        self.inflight: dict[bytes, int] = {}

    def take(self, parts: list) -> bool:
        """Whether to serve this message; a peer over its cap gets ``busy`` at once."""
        peer = parts[0]
        if self.inflight.get(peer, 0) < self.max_inflight:
            return True
        try:
            header = wire.unpack_header(bytes(parts[1]))
        except Exception:  # noqa: BLE001 - malformed: let the normal path answer it
            return True
        if not isinstance(header, dict) or header.get("op") in ("heartbeat", "bye"):
            return True
        req_id = header.get("id") if isinstance(header.get("id"), int) else None
        frames = wire.error_reply(req_id, "busy", f"{self.max_inflight} requests of this client "
                                  f"are in flight already ({self.cap}); nothing done")
        stats = self.stats()
        stats.add("busy")
        stats.add("errors")
        if self.backlog is not None:
            self.backlog.put(peer, frames)
            return False
        try:
            sent = self.sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # 65536 replies unread, or it is gone: the reply is dropped
            self.stats().add("replies_dropped")
            sent = None
        if isinstance(sent, asyncio.Future):  # zmq.asyncio: a failure lands in the future
            sent.add_done_callback(self._sent)
        return False

    def _sent(self, f) -> None:
        if not f.cancelled() and f.exception() is not None:  # its queue is full: dropped
            self.stats().add("replies_dropped")

    def track(self, peer: bytes, task) -> None:
        self.inflight[peer] = self.inflight.get(peer, 0) + 1
        task.add_done_callback(lambda _: self._done(peer))

    def _done(self, peer: bytes) -> None:
        left = self.inflight[peer] - 1
        if left:
            self.inflight[peer] = left
        else:
            del self.inflight[peer]
