"""``/metrics`` over HTTP on the daemon's event loop, bounded whoever connects.

``MetricsServer(render, max_connections, timeout_s, stats)`` serves ``GET /metrics`` on each
socket given to ``listen`` (TCP, or a Unix socket whose peers pass the access policy),
with no thread: one accept task per socket, one short task per connection. Bounds:
``max_connections`` at once per socket (more closed at once), ``timeout_s`` per connection,
``MAX_REQUEST`` bytes, an accept rate (``ACCEPT_RATE``/``ACCEPT_BURST``; more wait in the
kernel's backlog) and one rendering per ``RENDER_EVERY_S``: a flood of scrapes costs the loop
about 2%. Running out of descriptors pauses accepting for ``PAUSE_S``, never the daemon.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import socket
import struct
import time
from pathlib import Path

from kvd.server.peers import PeerCred
from kvd.server.runtime_dir import share_socket

log = logging.getLogger("kvd")
ACCEPT_RATE = 50.0
ACCEPT_BURST = 10
RENDER_EVERY_S = 0.25
MAX_REQUEST = 8192
MAX_READS = 16
BACKLOG = 128  # connections the kernel holds for us while we are not accepting
PAUSE_S = 0.1  # accepting pauses this long after an accept failed for want of descriptors
LOG_EVERY_S = 60.0
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_PEER_GONE = (errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN)  # just try again
_STATUS = {200: b"200 OK", 400: b"400 Bad Request", 404: b"404 Not Found",
           405: b"405 Method Not Allowed", 500: b"500 Internal Server Error"}


class _Listener:
    """A listening socket with its own connection count and accept budget: a flood on the
    TCP port leaves the Unix socket's peers their share."""

    def __init__(self, sock: socket.socket, policy):
        self.sock, self.policy = sock, policy
        self.open = 0  # connections being served
        self.tokens, self.refilled = float(ACCEPT_BURST), time.monotonic()

    async def pace(self) -> None:
        """Take a token of the accept budget, sleeping until one is there."""
        now = time.monotonic()
        self.tokens = min(ACCEPT_BURST, self.tokens + (now - self.refilled) * ACCEPT_RATE)
        self.refilled = now
        if self.tokens < 1.0:
            await asyncio.sleep((1.0 - self.tokens) / ACCEPT_RATE)
            self.tokens, self.refilled = 1.0, time.monotonic()
        self.tokens -= 1.0


class MetricsServer:
    def __init__(self, render, max_connections: int, timeout_s: float, stats):
        self.render = render  # () -> bytes: the exposition, on the loop
        self.max_connections = max_connections  # per listening socket
        self.timeout_s = timeout_s
        self.stats = stats
        self.listeners: list[_Listener] = []
        self.paths: list[Path] = []  # Unix sockets to remove at close
        self._tasks: set[asyncio.Task] = set()
        self._body, self._rendered = b"", -math.inf
        self._logged = -math.inf

    @property
    def open(self) -> int:
        return sum(lis.open for lis in self.listeners)

    def listen(self, sock: socket.socket, policy=None) -> None:
        """Serve the listening ``sock``; with ``policy`` (a Unix socket), only peers it allows."""
        if sock.family == socket.AF_UNIX:
            self.paths.append(Path(sock.getsockname()))
        sock.setblocking(False)
        listener = _Listener(sock, policy)
        self.listeners.append(listener)
        self._spawn(self._accept_loop(listener))

    def close(self) -> None:
        """Stop serving (tasks are cancelled with the loop's): close the listening sockets."""
        for task in self._tasks:
            task.cancel()
        for listener in self.listeners:
            listener.sock.close()
        for path in self.paths:
            path.unlink(missing_ok=True)
        self.listeners.clear()
        self.paths.clear()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- accepting ------------------------------------------------------------------------

    async def _accept_loop(self, lis: _Listener) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await lis.pace()
            try:
                conn, _ = await loop.sock_accept(lis.sock)
            except OSError as exc:
                if exc.errno not in _PEER_GONE:  # EMFILE, ENFILE, or worse: pause, never spin
                    self._cannot_accept(exc)
                    await asyncio.sleep(PAUSE_S)
                continue
            if lis.open >= self.max_connections or not _allowed(conn, lis.policy):
                self.stats.add("metrics_refused")
                conn.close()
                continue
            lis.open += 1
            self._spawn(self._serve(conn, lis))

    def _cannot_accept(self, exc: OSError) -> None:
        self.stats.add("metrics_accept_failed")
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.warning("metrics: cannot accept a connection (%s); pausing the endpoint, not "
                        "the daemon (%d metrics connections open)", exc.strerror, self.open)

    # ---- one connection -------------------------------------------------------------------

    async def _serve(self, conn: socket.socket, lis: _Listener) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        try:
            async with asyncio.timeout(self.timeout_s):
                request = await _read_request(loop, conn)
                if request is not None:
                    await loop.sock_sendall(conn, self._reply(request))
        except TimeoutError:
            self.stats.add("metrics_timeouts")
        except OSError:
            pass  # the peer reset or went away: nothing to tell it
        finally:
            conn.close()
            lis.open -= 1

    def _reply(self, request: bytes) -> bytes:
        parts = request.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            self.stats.add("metrics_bad_requests")
            return _response(400, b"bad request\n")
        method, path = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _response(405, b"only GET\n")
        if path not in (b"/metrics", b"/"):
            return _response(404, b"see /metrics\n")
        body = self._exposition()
        if body is None:
            return _response(500, b"rendering failed; see the daemon's log\n")
        return _response(200, body, head=method == b"HEAD")

    def _exposition(self) -> bytes | None:
        now = time.monotonic()
        if now - self._rendered >= RENDER_EVERY_S:
            try:
                self._body = self.render()
            except Exception:  # noqa: BLE001 - a bug of ours costs the scrape, not the daemon
                log.exception("metrics: rendering failed")
                return None
            self._rendered = now
        return self._body


async def _read_request(loop, conn: socket.socket) -> bytes | None:
    """The request head (through its blank line); None when the peer closed first or sent
    more than ``MAX_REQUEST`` bytes or ``MAX_READS`` pieces without finishing it."""
    head = b""
    for _ in range(MAX_READS):
        data = await loop.sock_recv(conn, MAX_REQUEST)
        if not data:
            return None
        head += data
        if b"\r\n\r\n" in head or b"\n\n" in head:
            return head
        if len(head) >= MAX_REQUEST:
            break
    return b""  # answered 400


def _response(status: int, body: bytes, head: bool = False) -> bytes:
    ctype = CONTENT_TYPE if status == 200 else b"text/plain; charset=utf-8"
    return (b"HTTP/1.1 " + _STATUS[status] + b"\r\nContent-Type: " + ctype
            + b"\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n" + (b"" if head else body))


def _allowed(conn: socket.socket, policy) -> bool:
    """Whether the peer of a Unix-socket connection passes ``policy`` (None: TCP, anyone)."""
    if policy is None:
        return True
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    pid, uid, gid = struct.unpack("3i", raw)
    return policy.allows(PeerCred(uid, gid, pid))


def tcp_listener(address: str, port: int) -> socket.socket:
    try:
        return socket.create_server((address, port), backlog=BACKLOG)
    except OSError as exc:
        raise RuntimeError(f"cannot serve metrics on {address}:{port}: {exc.strerror}") from None


def unix_listener(path: Path, group: int | None) -> socket.socket:
    """A listening Unix socket at ``path``, 0600 (0660 to ``group``); a stale socket there
    (nobody listening) is replaced, anything else is an error."""
    if path.is_socket() and not _listening(path):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot serve metrics on {path} (metrics_socket): "
                           f"{exc.strerror}") from None
    finally:
        os.umask(old)
    sock.listen(BACKLOG)
    share_socket(path, group)
    return sock


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(str(path)) == 0
