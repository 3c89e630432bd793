"""Engines of other users, for tests/server/test_access.py.

Run as a script under ``setpriv --reuid/--regid/--groups`` (the test suite
runs as root): ``python workers_access.py ROLE JSON_ARGS`` prints one JSON
line with what happened. Roles:

- ``engine``: connect, register a group-shared ``SharedKVPool``, store and
  load its own bytes back into other pages, read ``stats`` over the control
  socket while connected;
- ``holder``: create and register a pool, print its path, keep it until a
  line arrives on stdin (the file another user's engine will name);
- ``borrower``: register a pool whose buffer names someone else's file;
- ``connect``: only try to say hello.

``takeover`` (run in a spawned process of the test's own user) speaks on a
given routing id, as a process that learnt another's could.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import kvd_client
from kvd_client.transport import Channel
from kvd_protocol import wire
from kvd_protocol.errors import KvdError
from kvd_protocol.runtime import control_endpoint

CHUNK = 16
GEOMETRY = ("vllm_flash_attn", 2, 32, 16, 2, 8, "float16")  # layout, layers, pages, page, heads, dim


def _pool(group):
    return kvd_client.SharedKVPool(*GEOMETRY, group=group)


def _client(runtime_dir: str) -> kvd_client.KvdClient:
    return kvd_client.KvdClient(runtime_dir=runtime_dir, timeout=3, raise_errors=True).connect()


def engine(runtime_dir: str, group: int) -> dict:
    pool = _pool(group)
    try:
        with _client(runtime_dir) as c:
            c.register_kv(pool, model="access")
            pool.raw[:] = np.random.default_rng(os.getuid()).integers(0, 256, pool.raw.size, np.uint8)
            tokens = np.arange(2 * CHUNK) + os.getuid() * 1000
            stored = c.store(tokens, np.arange(2))
            loaded = c.load(tokens, np.arange(2, 4))
            same = all(np.array_equal(t[:, 0:2].view(np.uint8), t[:, 2:4].view(np.uint8))
                       for t in pool.tensors)
            ch = Channel(control_endpoint(Path(runtime_dir)), 3)
            try:
                stats = ch.request("stats")
            finally:
                ch.close()
        return {"stored": stored, "loaded": loaded, "bytes_match": same, "pool_mode":
                oct(os.stat(pool.path).st_mode & 0o777), "sessions": stats["sessions"]}
    finally:
        pool.close()


def tenant_stores(runtime_dir: str, group: int, tenants: list) -> dict:
    """A store under each label of ``tenants`` (None: no label): "ok" or the error's name."""
    pool = _pool(group)
    out = {}
    try:
        with _client(runtime_dir) as c:
            c.register_kv(pool, model="access")
            for i, tenant in enumerate(tenants):
                tokens = np.arange(CHUNK) + os.getuid() * 1000 + i * 100_000
                try:
                    c.store(tokens, np.arange(1), tenant=tenant)
                    out[str(tenant)] = "ok"
                except KvdError as exc:
                    out[str(tenant)] = type(exc).__name__
        return out
    finally:
        pool.close()


def holder(runtime_dir: str, group: int) -> None:
    pool = _pool(group)
    try:
        with _client(runtime_dir) as c:
            c.register_kv(pool, model="access")
            print(json.dumps({"path": str(pool.path)}), flush=True)
            sys.stdin.readline()
    finally:
        pool.close()


def borrower(runtime_dir: str, group: int, path: str) -> dict:
    pool = _pool(group)
    try:
        pool.buffers = [{**pool.buffers[0], "path": path}]
        with _client(runtime_dir) as c:
            try:
                c.register_kv(pool, model="access")
                return {"registered": True}
            except KvdError as exc:
                return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        pool.close()


def connect(runtime_dir: str) -> dict:
    try:
        _client(runtime_dir).close()
        return {"connected": True}
    except KvdError as exc:
        return {"error": type(exc).__name__}


def takeover(endpoint: str, routing_id: bytes) -> str:
    """Send a heartbeat on ``routing_id``; the daemon's answer's error code (or "ok")."""
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send_multipart(wire.encode_request(1, "heartbeat", {}, ()))
        if not sock.poll(5000):
            return "no reply"
        try:
            wire.parse_reply(sock.recv_multipart())
            return "ok"
        except KvdError as exc:
            return exc.code
    finally:
        sock.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    role, args = sys.argv[1], json.loads(sys.argv[2])
    result = {"engine": engine, "holder": holder, "borrower": borrower, "connect": connect,
              "tenant_stores": tenant_stores}[role](**args)
    if result is not None:
        print(json.dumps(result), flush=True)
