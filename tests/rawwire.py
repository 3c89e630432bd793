"""A bare ZeroMQ DEALER speaking kvd's wire protocol, for tests that need to say
exactly what an engine sends (bad input, protocol corner cases): no kvd_client.

``Raw(endpoint, ctx)`` sends frames as given and returns the decoded reply
header (skipping the daemon's liveness probes, id 0); ``ok``/``fails`` check
the reply; ``post`` sends a request without waiting and ``replies(n)``
collects the next ``n`` replies by id (pipelining, as a racing engine does);
``register_fields(pool)`` builds a register request for a ``SharedKVPool``
that carries a ``flags`` attribute (a ``ClientFlags``); ``nested(depth)``
is a msgpack array nested ``depth`` levels deep (msgpack-python's packer
refuses such values, so the bytes are written out).
"""

from __future__ import annotations

import os

import msgpack
import numpy as np
import zmq


class Raw:
    """A bare DEALER: sends frames as given, returns the decoded reply header."""

    def __init__(self, endpoint: str, ctx: zmq.Context):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 5000)  # a test never hangs on a send
        self.sock.connect(endpoint)
        self.errors = 0
        self.next_id = 1000

    def send(self, parts: list, timeout: float = 5.0):
        """Reply header (a dict), or None when no reply came within ``timeout``."""
        self.sock.send_multipart(parts)
        while True:
            if not self.sock.poll(int(timeout * 1000)):
                return None
            reply = self.sock.recv_multipart()
            assert len(reply) == 1, reply
            header = msgpack.unpackb(reply[0], raw=False)
            if header.get("id") != 0:
                break  # id 0: the daemon's liveness probe, not a reply
        assert header["v"] == 2
        if "error" in header:
            self.errors += 1
        return header

    def post(self, op, frames=(), **fields) -> int:
        """Send a request without waiting for its reply; returns its id."""
        self.next_id += 1
        self.sock.send_multipart([pack({"v": 2, "id": self.next_id, "op": op, **fields}), *frames])
        return self.next_id

    def replies(self, n: int, timeout: float = 10.0) -> dict:
        """The next ``n`` reply headers by id (liveness probes skipped); fewer on a timeout."""
        got = {}
        while len(got) < n and self.sock.poll(int(timeout * 1000)):
            header = msgpack.unpackb(self.sock.recv_multipart()[0], raw=False)
            if header.get("id") != 0:
                got[header.get("id")] = header
        return got

    def call(self, op, frames=(), **fields):
        self.next_id += 1
        if op == "load":  # every load names a flag-page slot and a seq (tests of those omit them)
            fields = {"slot": 0, "seq": self.next_id, **fields}
            fields = {k: v for k, v in fields.items() if v is not OMIT}
        return self.send([pack({"v": 2, "id": self.next_id, "op": op, **fields}), *frames])

    def ok(self, op, frames=(), **fields):
        reply = self.call(op, frames, **fields)
        assert reply is not None and "result" in reply, (op, reply)
        assert reply["id"] == self.next_id
        return reply["result"]

    def fails(self, code: str, op, frames=(), **fields) -> str:
        reply = self.call(op, frames, **fields)
        return _check_error(reply, code, self.next_id, (op, fields, [len(f) for f in frames]))

    def fails_raw(self, code: str, parts: list, req_id=None) -> str:
        return _check_error(self.send(parts), code, req_id, parts[:1])

    def hello(self):
        return self.ok("hello", client="raw", pid=os.getpid(), versions=[2])

    def register(self, pool, model="good", **overrides):
        fields = register_fields(pool, model)
        fields.update(overrides)
        return self.ok("register", **fields)["reg"]

    def close(self):
        self.sock.close(linger=0)


def _check_error(reply, code, req_id, what) -> str:
    assert reply is not None, f"no reply to {what}"
    assert "result" not in reply, f"{what} succeeded: {reply}"
    assert reply["error"]["code"] == code, f"{what}: {reply['error']}"
    assert reply["id"] == req_id, f"{what}: reply id {reply['id']}, expected {req_id}"
    assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
    return reply["error"]["message"]


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def nested(depth: int) -> bytes:
    """msgpack bytes of ``[[[...nil...]]]``, ``depth`` arrays deep."""
    return b"\x91" * depth + b"\xc0"


def header_with(raw_fields: dict, **fields) -> bytes:
    """A request header map: ``fields`` packed, ``raw_fields`` given as msgpack bytes."""
    body = b"".join(pack(k) + pack(v) for k, v in fields.items())
    body += b"".join(pack(k) + v for k, v in raw_fields.items())
    count = len(fields) + len(raw_fields)
    assert count < 16
    return bytes([0x80 | count]) + body


def pages(*ids) -> bytes:
    return np.asarray(ids, dtype="<i8").tobytes()


def namespace(pool, model="good", **overrides) -> dict:
    ns = {"model": model, "kv_dtype": pool.kv_dtype, "attention": pool.attention,
          "num_layers": pool.num_layers, "kv_heads": pool.kv_heads, "head_dim": pool.head_dim,
          "tp_size": 1, "first_layer": 0, "fingerprint": ""}
    ns.update(overrides)
    return ns


def layout(pool, **overrides) -> dict:
    d = pool.descriptor
    wire = {"num_layers": d.num_layers, "planes": d.planes, "num_pages": d.num_pages,
            "page_size": d.page_size, "row_bytes": d.row_bytes, "page_stride": d.page_stride,
            "token_stride": d.token_stride, "bases": [list(b) for b in d.bases]}
    wire.update(overrides)
    return wire


OMIT = object()  # a field a test leaves out on purpose


def register_fields(pool, model="good") -> dict:
    return {"namespace": namespace(pool, model), "tp_rank": 0,
            "buffers": [{"kind": "shm", "path": str(pool.path), "size": pool.size}],
            "layout": layout(pool), "flags": pool.flags.spec}


