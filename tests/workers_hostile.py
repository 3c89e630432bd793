"""Hostile but admitted peers of the daemon, for the tests of issue 56 (run in spawned
processes or threads; each returns what it did).

``open_idle`` opens ``n`` ZeroMQ connections to a socket that never send a request;
``hello_flood`` sends valid ``hello``s from one socket back to back; ``malformed_flood``
sends a malformed frame from a fresh socket each time (a new routing id each); and
``pipelined_health`` sends ``n`` ``health`` requests on one socket before reading any
reply and counts what comes back.
"""

from __future__ import annotations

import os
import time

import zmq

from kvd_protocol import wire


def open_idle(ctx: zmq.Context, endpoint: str, n: int) -> list:
    """``n`` DEALER sockets connected to ``endpoint`` (handshaken, never a request); the
    caller closes them."""
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        socks.append(s)
    return socks


def hello_flood(endpoint: str, seconds: float, name: str = "flood", pause: float = 0.0) -> dict:
    """Valid ``hello``s, each awaited, for ``seconds`` (``pause`` seconds apart)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(endpoint)
    sent, deadline = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            sent += 1
            s.send_multipart(wire.encode_request(sent, "hello", {"versions": [wire.VERSION],
                                                 "client": name, "pid": os.getpid()}))
            s.recv_multipart()
            time.sleep(pause)
        return {"hellos": sent}
    finally:
        s.close(linger=0)
        ctx.term()


def malformed_flood(endpoint: str, seconds: float, pause: float = 0.0) -> dict:
    """A malformed request from a fresh socket (a fresh routing id) each time (``pause``
    seconds apart)."""
    ctx = zmq.Context()
    sent, deadline = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 5000)
            s.connect(endpoint)
            s.send_multipart([b"\xc1 not msgpack"])
            try:
                s.recv_multipart()
            except zmq.Again:
                pass
            s.close(linger=0)
            sent += 1
            time.sleep(pause)
        return {"malformed": sent}
    finally:
        ctx.term()


def pipelined_health(endpoint: str, n: int, timeout: float = 10.0) -> dict:
    """``n`` health requests sent before any reply is read; the codes of the replies that
    came back within ``timeout`` (``ok`` or an error code)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(endpoint)
    try:
        for i in range(1, n + 1):
            s.send_multipart(wire.encode_request(i, "health"))
        codes, ids = {}, set()
        deadline = time.monotonic() + timeout
        while len(ids) < n and s.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            reply = wire.unpack_header(s.recv_multipart()[-1])
            ids.add(reply.get("id"))
            code = "ok" if "result" in reply else reply.get("error", {}).get("code")
            codes[code] = codes.get(code, 0) + 1
        return {"codes": codes, "ids": len(ids), "lost": n - len(ids)}
    finally:
        s.close(linger=0)
        ctx.term()


def connect_when_room(runtime_dir: str, seconds: float) -> dict:
    """One client that says hello again and again (the same client object) until the
    daemon admits it or ``seconds`` pass: how many tries were refused first."""
    import kvd_client
    from kvd_protocol.errors import KvdError
    client = kvd_client.KvdClient(runtime_dir=runtime_dir, timeout=0.5, raise_errors=True)
    refused, deadline = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                client.connect()
                return {"refused": refused, "connected": True}
            except KvdError:
                refused += 1
                time.sleep(0.2)
        return {"refused": refused, "connected": False}
    finally:
        client.close()
