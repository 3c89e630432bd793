"""Replies that wait for room in a peer's reply queue instead of being dropped.

``Backlog(sock, stats).put(peer, frames)`` sends a reply at once when the peer's ZeroMQ queue
has room and nothing of it waits; else the reply joins the peer's backlog, moved into the
queue in order as the peer reads, so a control client that pipelines hundreds of requests
gets every reply (or its ``busy``). Bounds: ``MAX_BYTES`` waiting per peer, and a peer that
reads nothing for ``REPLY_PATIENCE_S`` loses them; each lost reply is counted
(``replies_dropped``, one log line per peer per minute). A gone peer's replies are dropped
silently. Peers are bounded by the socket's connection cap (kvd.server.connections).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import zmq

from kvd.server.peers_alive import DROPPED, REPLY_PATIENCE_S

log = logging.getLogger("kvd")
MAX_BYTES = 256 * 1024  # of replies waiting per peer: about 2,000 busy replies


class Backlog:
    def __init__(self, sock, stats):
        self.sock, self.stats = sock, stats
        self.waiting: dict[bytes, deque] = {}
        self.bytes: dict[bytes, int] = {}
        self.tasks: set[asyncio.Task] = set()

    def put(self, peer: bytes, frames: list) -> None:
        queue = self.waiting.get(peer)
        if queue is None:
            if self._send(peer, frames) is not False:
                return
            queue = self.waiting[peer] = deque()
            self.bytes[peer] = 0
            task = asyncio.ensure_future(self._drain(peer, queue))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        size = sum(len(f) for f in frames)
        if self.bytes[peer] + size > MAX_BYTES:
            self._dropped(peer, 1, f"{MAX_BYTES} bytes of replies wait for it already")
            return
        queue.append(frames)
        self.bytes[peer] += size

    def _send(self, peer: bytes, frames: list) -> bool | None:
        """True: queued in ZeroMQ; False: its queue is full; None: the peer is gone."""
        sent = self.sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK)
        if not isinstance(sent, asyncio.Future):  # a plain zmq socket: sent, or raised
            return True
        if not sent.done():  # not for NOBLOCK sends; the socket sends it when it can
            return True
        exc = sent.exception()
        if exc is None:
            return True
        return False if isinstance(exc, zmq.Again) else None

    async def _drain(self, peer: bytes, queue: deque) -> None:
        pause, progress = 0.001, time.monotonic()
        try:
            while queue:
                sent = self._send(peer, queue[0])
                if sent is False:
                    if time.monotonic() - progress > REPLY_PATIENCE_S:
                        self._dropped(peer, len(queue), f"it has not read a reply for "
                                      f"{REPLY_PATIENCE_S:.0f} s")
                        return
                    await asyncio.sleep(pause)  # backing off: many waiting peers must not spin
                    pause = min(pause * 2, 0.05)
                    continue
                if sent is None:
                    return
                self.bytes[peer] -= sum(len(f) for f in queue.popleft())
                pause, progress = 0.001, time.monotonic()
        finally:
            self.waiting.pop(peer, None)
            self.bytes.pop(peer, None)

    def _dropped(self, peer: bytes, n: int, why: str) -> None:
        self.stats.add("replies_dropped", n)
        held = DROPPED.due(peer)
        if held is not None:
            log.warning("%d control replies dropped: %s (%d more dropped for it since the last "
                        "such line)", n, why, held)
