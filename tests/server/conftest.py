"""Fixtures of the daemon tests that speak the wire protocol by hand (tests/rawwire.py).

``zctx``: a ZeroMQ context for raw sockets. For the bad-input tests
(test_bad_input.py, test_bad_register.py): ``good``, a well-behaved engine
with 4 chunks stored (tests/good_engine.py), and ``raw_pool``, a pool of
its geometry for raw registrations. For the pipeline tests (test_pipeline.py,
test_pipeline_loads.py): ``raw_engine``, a raw engine with a registered pool.
"""

from __future__ import annotations

import good_engine
import pytest
import workers_pipeline as WP
import zmq
from rawwire import Raw

import kvd_client
from kvd_client.flags import ClientFlags
from kvd_protocol.runtime import engine_endpoint


@pytest.fixture
def zctx():
    """A ZeroMQ context for raw sockets; destroyed with every socket a failed test left open."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def good(daemon):
    g = good_engine.Good(daemon)
    yield g
    g.close()


@pytest.fixture
def raw_pool():
    """A second pool of the good client's geometry, for raw registrations (zero-filled),
    with a flag page of 8 load slots."""
    pool = kvd_client.SharedKVPool(*good_engine.GEOMETRY)
    pool.flags = ClientFlags(pool.num_layers, 8)
    yield pool
    pool.flags.close()
    pool.close()


@pytest.fixture
def raw_engine(daemon, zctx):
    """A raw engine with a registered pool (zero-filled) and an 8-slot flag page."""
    pool = kvd_client.SharedKVPool(*WP.GEOMETRY)
    pool.flags = ClientFlags(pool.num_layers, 8)
    raw = Raw(engine_endpoint(daemon.runtime_dir), zctx)
    raw.hello()
    raw.reg = raw.register(pool, model="pipe")
    raw.pool = pool
    yield raw
    raw.close()
    pool.flags.close()
    pool.close()
