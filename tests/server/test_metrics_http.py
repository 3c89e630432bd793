"""The /metrics HTTP server (kvd/server/metrics_http.py) on an asyncio loop, real sockets.

Each test runs a ``MetricsServer`` over a stand-in renderer on a fresh loop
and talks to it through real TCP or Unix sockets from threads (blocking
clients, as scrapers are): replies, the connection cap, the deadline, the
render cache, the peer check of the Unix socket, and (in a process with 48
descriptors) running out of descriptors.
"""

from __future__ import annotations

import asyncio
import socket
import stat
import subprocess
import sys
import time
from collections import Counter

import pytest

from kvd.server import metrics_http as M


class Stats:
    def __init__(self):
        self.counters = Counter()

    def add(self, name: str) -> None:
        self.counters[name] += 1


class Refuse:
    def allows(self, cred) -> bool:
        return False


def serve(test):
    """Run ``test(server, addr)`` (a coroutine) against a server on a TCP socket."""
    async def run():
        renders = Counter()

        def render() -> bytes:
            renders["n"] += 1
            return b"kvd_up 1\n"

        server = M.MetricsServer(render, 4, 0.5, Stats())
        server.renders = renders
        sock = M.tcp_listener("127.0.0.1", 0)
        server.listen(sock)
        try:
            await test(server, sock.getsockname())
        finally:
            server.close()
    asyncio.run(run())


def fetch(addr, request: bytes = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
          family=socket.AF_INET) -> bytes:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(addr)
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


async def in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def test_replies():
    async def check(server, addr):
        ok = await in_thread(fetch, addr)
        assert ok.startswith(b"HTTP/1.1 200 OK\r\n") and ok.endswith(b"\r\n\r\nkvd_up 1\n")
        assert b"Content-Length: 9\r\n" in ok and b"version=0.0.4" in ok
        head = await in_thread(fetch, addr, b"HEAD / HTTP/1.0\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")
        assert (await in_thread(fetch, addr, b"GET /x HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404")
        assert (await in_thread(fetch, addr, b"POST / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405")
        assert (await in_thread(fetch, addr, b"junk\r\n\r\n")).startswith(b"HTTP/1.1 400")
        try:  # too long: closed after 8 KiB (with the rest unread, the 400 may be lost to a reset)
            assert (await in_thread(fetch, addr, b"x" * 20000)).startswith(b"HTTP/1.1 400")
        except ConnectionResetError:
            pass
        assert server.stats.counters["metrics_bad_requests"] == 2
        assert server.renders["n"] == 1  # rendered once for both scrapes within RENDER_EVERY_S
        await asyncio.sleep(M.RENDER_EVERY_S)
        await in_thread(fetch, addr)
        assert server.renders["n"] == 2
        assert server.open == 0
    serve(check)


def test_connections_past_the_cap_are_closed_at_once_and_idle_ones_at_the_deadline():
    async def check(server, addr):
        idle = []
        for _ in range(4):  # the cap
            s = socket.create_connection(addr)
            idle.append(s)
        await asyncio.sleep(0.1)
        assert server.open == 4
        extra = socket.create_connection(addr)
        extra.settimeout(2)
        assert await in_thread(extra.recv, 1) == b""  # closed at once, well before 0.5 s
        assert server.stats.counters["metrics_refused"] == 1
        extra.close()
        await asyncio.sleep(0.6)  # the deadline: the idle ones are closed
        assert server.open == 0 and server.stats.counters["metrics_timeouts"] == 4
        for s in idle:
            assert s.recv(1) == b""
            s.close()
        assert (await in_thread(fetch, addr)).startswith(b"HTTP/1.1 200")
    serve(check)


def test_accepting_is_paced():
    async def check(server, addr):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        n = M.ACCEPT_BURST + 10
        for _ in range(n):
            await in_thread(fetch, addr)
        assert loop.time() - t0 >= 10 / M.ACCEPT_RATE * 0.9
    serve(check)


@pytest.mark.parametrize("refused", [False, True])
def test_the_unix_socket_is_private_and_checks_its_peers(tmp_path, refused):
    async def run():
        server = M.MetricsServer(lambda: b"kvd_up 1\n", 4, 0.5, Stats())
        path = tmp_path / "metrics.sock"
        server.listen(M.unix_listener(path, None), Refuse() if refused else None)
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0  # the daemon's user only
        try:
            return await in_thread(fetch, str(path), b"GET /metrics HTTP/1.0\r\n\r\n",
                                   socket.AF_UNIX), server
        except (ConnectionResetError, BrokenPipeError):  # closed at once, the request unread
            return b"", server
        finally:
            server.close()
            assert not path.exists()

    out, server = asyncio.run(run())
    if refused:
        assert out == b"" and server.stats.counters["metrics_refused"] == 1
    else:
        assert out.endswith(b"kvd_up 1\n")


def test_a_live_socket_at_the_path_is_not_taken_over(tmp_path):
    path = tmp_path / "metrics.sock"
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(path))
        other.listen()
        with pytest.raises(RuntimeError, match="cannot serve metrics on"):
            M.unix_listener(path, None)
    stale = M.unix_listener(path, None)  # nobody listens there any more: replaced
    stale.close()


SERVER = """
import asyncio, sys
from collections import Counter
from kvd.server import metrics_http as M

class Stats:
    counters = Counter()
    def add(self, name):
        self.counters[name] += 1

async def main():
    stats = Stats()
    render = lambda: str(dict(stats.counters)).encode()
    server = M.MetricsServer(render, 1000, 5.0, stats)  # a cap above the descriptors it has
    sock = M.tcp_listener("127.0.0.1", 0)
    server.listen(sock)
    print(sock.getsockname()[1], flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_running_out_of_descriptors_pauses_accepting_only():
    """With its descriptors gone (EMFILE), the server pauses accepting, counts it and serves
    again once some are back; the process never dies of it."""
    proc = subprocess.Popen(["prlimit", "--nofile=48:48", "--", sys.executable, "-c", SERVER],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        conns = []
        for _ in range(100):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            conns.append(s)
        time.sleep(1.5)
        assert proc.poll() is None
        for s in conns:
            s.close()
        deadline = time.monotonic() + 20
        while True:  # once the held ones see their peers gone, it serves again
            try:
                out = fetch(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline, "no scrape after the descriptors came back"
                time.sleep(0.2)
        assert out.startswith(b"HTTP/1.1 200") and b"'metrics_accept_failed'" in out
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
