"""Fixtures of the daemon tests that speak the wire protocol by hand (tests/rawwire.py)."""

from __future__ import annotations

import pytest
import zmq


@pytest.fixture
def zctx():
    """A ZeroMQ context for raw sockets; destroyed with every socket a failed test left open."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
