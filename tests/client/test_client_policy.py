"""What the client does with failures: contract errors raise, unavailability degrades,
retries follow the caller's ``Retry`` policy, and an engine may start before the daemon."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvd_client
from kvd_protocol.errors import OutOfRange, TooLarge


@pytest.fixture
def pool():
    p = kvd_client.SharedKVPool("vllm_flash_attn", 2, 64, 4, 2, 8, "float16")
    p.raw[:] = np.random.default_rng(1).integers(0, 256, p.raw.size, dtype=np.uint8)
    yield p
    p.close()


def test_contract_errors_raise_even_when_misses_are_quiet(start_daemon, pool):
    d = start_daemon(max_keys_per_request=4)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=False) as c:
        c.register_kv(pool, model="policy")
        with pytest.raises(OutOfRange):  # a page id past the pool: the caller's bug
            c.store(np.arange(16), [0, 1, 2, 64])
        with pytest.raises(TooLarge):    # more keys than the daemon takes in one request
            c.lookup(np.arange(16 * 5))
        with pytest.raises(ValueError, match="page ids"):
            c.store(np.arange(32), [0, 1, 2, 3])  # two chunks need eight page ids
        assert c.store(np.arange(16), [0, 1, 2, 3]) == 16
    assert d.stop() == 0


def test_unavailability_degrades_to_misses(start_daemon, pool):
    d = start_daemon()
    c = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), timeout=1.0).connect()
    try:
        c.register_kv(pool, model="policy")
        assert c.store(np.arange(16), [0, 1, 2, 3]) == 16
        d.stop()
        t0 = time.monotonic()
        assert c.lookup(np.arange(16)) == 0
        assert c.load(np.arange(16), [4, 5, 6, 7]) == 0
        assert c.store(np.arange(16), [0, 1, 2, 3]) == 0
        assert time.monotonic() - t0 < 3.0  # no socket: each call fails at once
    finally:
        c.close()


def test_an_engine_started_before_the_daemon_registers_when_it_appears(start_daemon, pool,
                                                                        tmp_path):
    rd = tmp_path / "run"
    c = kvd_client.KvdClient(runtime_dir=str(rd), timeout=2.0).connect()  # no daemon: no raise
    try:
        reg = c.register_kv(pool, model="early")
        assert reg.id == 0 and c.lookup(np.arange(16)) == 0
        d = start_daemon(runtime_dir=rd)
        deadline = time.monotonic() + 10
        while d.stats()["registrations"] == 0:  # the background thread said hello by itself
            assert time.monotonic() < deadline, "the pool was not registered"
            time.sleep(0.05)
        assert c.store(np.arange(16), [0, 1, 2, 3]) == 16
        assert c.load(np.arange(16), [4, 5, 6, 7]) == 16
    finally:
        c.close()


@pytest.mark.parametrize("attempts", [0, 1])
def test_retry_policy_after_a_daemon_restart(start_daemon, pool, attempts):
    """``Retry(0)``: the first call after a restart is a miss; ``Retry(1)`` (the default):
    the client says hello, registers again and resends at once."""
    d = start_daemon()
    c = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), timeout=5.0, heartbeat=False,
                             retry=kvd_client.Retry(attempts)).connect()
    try:
        c.register_kv(pool, model="retry")
        assert c.store(np.arange(16), [0, 1, 2, 3]) == 16
        d.stop()
        d2 = start_daemon(runtime_dir=d.runtime_dir)
        deadline = time.monotonic() + 5
        while not (d2.runtime_dir / "kvd.sock").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.2)  # the DEALER reconnects to the new daemon (up to 1 s)
        first = c.store(np.arange(16), [0, 1, 2, 3])
        assert first == (16 if attempts else 0)
        assert c.store(np.arange(16), [0, 1, 2, 3]) == 16  # registered again by now
    finally:
        c.close()
