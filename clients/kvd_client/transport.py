"""Requests and replies over one ZeroMQ DEALER, pipelined, with timeouts.

``Channel.send`` queues a request and returns its id (``DaemonUnavailable`` when there is no
daemon); ``collect(timeout)`` returns every reply arrived as ``(id, result, error)`` with
typed ``ServerError``s; ``request`` is the blocking form (``Timeout``: the request may still
run); replies to ``forget``-ten ids are dropped. One routing id for the channel's life; a
socket idle for ``REOPEN_S`` with no reply awaited is replaced (same routing id) at the next
send, since ZeroMQ never retries a connection the daemon's caps refused. Thread-safe under
one lock nobody sleeps holding (waits sleep in ``select``); ``spin_s`` > 0 busy-polls first.
"""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path

import zmq

from kvd_protocol import wire
from kvd_protocol.errors import DaemonUnavailable, ServerError, Timeout

SLICE_S = 0.005  # longest sleep before the table is looked at again (another thread may drain)
REOPEN_S = 1.0  # a socket that could not send this long, with nothing awaited, is replaced


class Channel:
    def __init__(self, endpoint: str, timeout: float = 5.0, spin_s: float = 0.0):
        self.endpoint = endpoint
        self.timeout = timeout
        self.spin_s = spin_s
        self._ctx = zmq.Context()
        self._lock = threading.RLock()
        self._next_id = 0
        self._pid = os.getpid()
        self._down = False  # last attempt found no daemon: fail fast until one is back
        self._replies: dict[int, tuple] = {}
        self._waiting: set[int] = set()  # ids whose replies are wanted
        self._routing_id = os.urandom(16)
        self._sock = self._open()
        self._fd = self._sock.getsockopt(zmq.FD)
        self._opened = time.monotonic()

    def _open(self):
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self._routing_id)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a daemon that is not there
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.connect(self.endpoint)
        return sock

    def socket_exists(self) -> bool:
        """Whether an ``ipc://`` endpoint's socket file may exist (no daemon if not; a file
        we may not even look at is left to ZeroMQ to fail on)."""
        try:
            return not self.endpoint.startswith("ipc://") or Path(self.endpoint[6:]).exists()
        except PermissionError:
            return True

    # ---- pipelined -------------------------------------------------------------------

    def reserve_id(self) -> int:
        """An id for a request about to be sent (so a caller can expect its reply first)."""
        with self._lock:
            self._next_id += 1
            return self._next_id

    def send(self, op: str, fields: dict | None = None, frames=(), wait: float | None = None,
             req_id: int | None = None) -> int:
        """Send a request (``req_id`` from ``reserve_id``, or a new one); returns its id.
        Waits up to ``wait`` seconds (default: the channel's timeout; 50 ms while no daemon
        answered last time) for the daemon to take it, never holding the lock meanwhile:
        other threads collect replies and send heartbeats."""
        wait = (0.05 if self._down else self.timeout) if wait is None else wait
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                if self._sock is None:
                    raise DaemonUnavailable("the channel is closed")
                if os.getpid() != self._pid:
                    raise DaemonUnavailable("channel used after fork; create a new client in the child")
                if not self.socket_exists():
                    self._down = True
                    raise DaemonUnavailable(f"kvd is not reachable at {self.endpoint}")
                if self._sock.poll(0, zmq.POLLOUT):
                    return self._send_now(op, fields, frames, req_id)
            left = deadline - time.monotonic()
            if left <= 0:
                with self._lock:
                    self._down = True
                    self._reopen_if_refused()
                raise DaemonUnavailable(f"kvd is not reachable at {self.endpoint}")
            time.sleep(min(SLICE_S, left))

    def _reopen_if_refused(self) -> None:
        """Replace a socket with no connection to send on (under the lock): ZeroMQ does not
        retry a connection refused in the handshake. Never while replies are awaited (the
        connection is there, the daemon merely slow: its queued requests stay)."""
        now = time.monotonic()
        if self._sock is None or self._waiting or now - self._opened < REOPEN_S:
            return
        self._sock.close(linger=0)
        self._sock = self._open()
        self._fd = self._sock.getsockopt(zmq.FD)
        self._opened = now

    def _send_now(self, op: str, fields, frames, req_id: int | None) -> int:
        if req_id is None:
            self._next_id += 1
            req_id = self._next_id
        try:
            self._sock.send_multipart(wire.encode_request(req_id, op, fields, frames),
                                      flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._down = True
            raise DaemonUnavailable(f"kvd is not reachable at {self.endpoint}") from None
        self._down = False
        self._waiting.add(req_id)
        return req_id

    def collect(self, timeout: float = 0.0) -> list[tuple]:
        """Replies that arrived, waiting up to ``timeout`` for the first one."""
        deadline = time.monotonic() + timeout
        spin_end = time.monotonic() + min(self.spin_s, timeout)
        while True:
            with self._lock:
                self._drain()
                if self._replies:
                    out = list(self._replies.items())
                    self._replies.clear()
                    return [(i, *r) for i, r in out]
            now = time.monotonic()
            if now >= deadline:
                return []
            if now < spin_end:
                os.sched_yield()
                continue
            _sleep_on(self._fd, min(deadline - now, SLICE_S))

    def forget(self, req_id: int) -> None:
        with self._lock:
            self._waiting.discard(req_id)
            self._replies.pop(req_id, None)

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            parts = sock.recv_multipart(zmq.NOBLOCK)
            try:
                req_id, result = wire.parse_reply(parts)
                error = None
            except ServerError as exc:
                req_id, result, error = getattr(exc, "req_id", None), None, exc
            if req_id is None and error is not None and len(self._waiting) == 1:
                req_id = next(iter(self._waiting))  # the daemon could not read our header
            if req_id in self._waiting:
                self._waiting.discard(req_id)
                self._replies[req_id] = (result, error)

    # ---- blocking ----------------------------------------------------------------------

    def request(self, op: str, fields: dict | None = None, frames=(), timeout: float | None = None):
        """Send one request and wait for its reply: the result, or its typed error raised."""
        timeout = self.timeout if timeout is None else timeout
        req_id = self.send(op, fields, frames)
        got = self.wait_for(req_id, time.monotonic() + timeout)
        if got is None:
            raise Timeout(f"kvd did not answer {op} within {timeout:g} s")
        result, error = got
        if error is not None:
            raise error
        return result

    def wait_for(self, req_id: int, deadline: float):
        """(result, error) of ``req_id`` once it arrived, or None at ``deadline`` (the id
        is then forgotten). Other replies that arrive meanwhile stay for ``collect``."""
        spin_end = time.monotonic() + self.spin_s
        while True:
            with self._lock:
                self._drain()
                if req_id in self._replies:
                    return self._replies.pop(req_id)
            now = time.monotonic()
            if now >= deadline:
                self.forget(req_id)
                return None
            if now < spin_end:
                os.sched_yield()
                continue
            _sleep_on(self._fd, min(deadline - now, SLICE_S))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
                self._ctx.term()


def _sleep_on(fd: int, seconds: float) -> None:
    """Sleep until ``fd`` is readable or ``seconds`` pass (the socket may just have been
    replaced: its old descriptor closed)."""
    try:
        select.select([fd], [], [], seconds)
    except (OSError, ValueError):
        time.sleep(seconds)
