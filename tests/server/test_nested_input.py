"""Deeply nested msgpack values against a real daemon, on both sockets.

A 1,000-deep array is still valid msgpack (msgpack-python decodes up to
1,024 levels), so it reaches validation. Wherever it stands (``op``, ``v``,
``hello.versions``), the reply must be ``bad_request`` with the request's
id, the daemon must go on serving, and a flood of such frames must cost
the daemon's log a few lines, not a traceback each (per peer, malformed
input is logged at most once per interval).
"""

from __future__ import annotations

import pytest
from rawwire import Raw, header_with, nested

from kvd_protocol.runtime import control_endpoint, engine_endpoint

DEPTH = 1000
FLOOD = 1000


def _engine_frames(req_id: int) -> list[bytes]:
    deep = nested(DEPTH)
    return [header_with({"op": deep}, v=2, id=req_id),
            header_with({"v": deep}, id=req_id, op="heartbeat"),
            header_with({"versions": deep}, v=2, id=req_id, op="hello", client="raw", pid=1)]


def _control_frames(req_id: int) -> list[bytes]:
    deep = nested(DEPTH)
    return [header_with({"op": deep}, v=2, id=req_id),
            header_with({"v": deep}, id=req_id, op="stats")]


def _refused(raw: Raw, frame: bytes, req_id: int) -> None:
    reply = raw.send([frame])
    assert reply is not None, "no reply to a nested value"
    assert reply.get("error", {}).get("code") == "bad_request", reply
    assert reply["id"] == req_id


@pytest.mark.parametrize("socket", ["engine", "control"])
def test_nested_values_are_bad_requests(daemon, zctx, socket):
    endpoint, frames = ((engine_endpoint, _engine_frames) if socket == "engine"
                        else (control_endpoint, _control_frames))
    raw = Raw(endpoint(daemon.runtime_dir), zctx)
    if socket == "engine":
        raw.hello()  # a peer with a session keeps it through the flood
    for frame in frames(7):
        _refused(raw, frame, 7)
    lines = len(daemon.log().splitlines())
    for i in range(FLOOD):
        batch = frames(100 + i)
        _refused(raw, batch[i % len(batch)], 100 + i)
    grown = daemon.log().splitlines()[lines:]
    assert len(grown) <= 3, f"{len(grown)} log lines for {FLOOD} nested frames:\n" + \
        "\n".join(grown[:40])
    assert "Traceback" not in daemon.log()
    if socket == "engine":
        assert raw.ok("heartbeat") == {}  # the session survived
        raw.ok("bye")
    else:
        assert raw.ok("health")["status"] == "ok"
    raw.close()
