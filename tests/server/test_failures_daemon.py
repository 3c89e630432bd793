"""Failure model, the daemon: restarts and crashes, one daemon per runtime dir, bad config.

kvd is a cache: it may lose entries but never takes an engine down. A
daemon that stops or crashes turns client calls into quick misses, and a
new daemon on the same runtime dir reclaims the sockets the old one left,
adopts its host tier (warm restart: tests/server/test_warm_restart.py has
the details) and serves the same client objects again. A second daemon on
a busy runtime dir and a bad config both refuse to start. Dead clients and
leases: tests/server/test_failures.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import workers_failures as W
from daemons import wait_for
from shm_files import arena_files
from workers_failures import random_pool, same_pages

import kvd_client
from kvd_protocol.runtime import instance_tag


def arenas(daemon) -> list[Path]:
    return arena_files(daemon.runtime_dir)


# ---- (a) daemon restart under a connected client ---------------------------------

def test_a_late_no_session_answer_does_not_cost_the_new_session_its_pools(daemon):
    """A ``no_session`` answer to a request sent before the client's latest hello (e.g. a
    heartbeat queued while the daemon restarted, read after the hello) must not make the
    client hello again: that would reap the new session and its registrations under the
    engine's feet. An answer about the current session does bring a hello."""
    client = kvd_client.KvdClient(runtime_dir=str(daemon.runtime_dir), timeout=5.0,
                                  raise_errors=True, heartbeat=False).connect()
    pool = random_pool(32)
    tokens = np.arange(64)
    try:
        client.register_kv(pool, model="late-answer")
        hellos = daemon.log().count("connected")
        client._pump.session_lost(client._hellos - 1)  # about the session before this one
        assert client.store(tokens, np.arange(16)) == 64
        assert daemon.log().count("connected") == hellos, "a needless hello"
        assert daemon.stats()["registrations"] == 1
        client._pump.session_lost(client._hellos)  # about this session: hello and register again
        assert client.load(tokens, np.arange(16, 32)) == 64
        wait_for(lambda: daemon.log().count("connected") == hellos + 1, 5, "the second hello")
        stats = daemon.stats()
        assert stats["clients"] == 1 and stats["registrations"] == 1
    finally:
        client.close()
        pool.close()


def test_daemon_restart_with_connected_client(start_daemon):
    d1 = start_daemon()
    rd = d1.runtime_dir
    client = kvd_client.KvdClient(runtime_dir=str(rd), timeout=1.0, raise_errors=False).connect()
    pool = random_pool(31)
    tokens = np.arange(64)
    try:
        client.register_kv(pool, model="restart")
        assert client.store(tokens, np.arange(16)) == 64
        arena = arenas(d1)
        assert [p.name for p in arena] == [f"kvd-arena-{instance_tag(rd)}",
                                           f"kvd-arena-{instance_tag(rd)}.index"]
        assert d1.stop() == 0, d1.log()
        assert not (rd / "kvd.sock").exists() and not (rd / "control.sock").exists()
        assert arenas(d1) == arena, "the host tier is kept for the next start"
        # Daemon gone: misses within the timeout, never an exception.
        for call in [lambda: client.lookup(tokens), lambda: client.store(tokens, np.arange(16)),
                     lambda: client.load(tokens, np.arange(16, 32)),
                     lambda: client.lookup_lease(tokens, 1000)[0]] * 3:
            t0 = time.monotonic()
            assert call() == 0
            assert time.monotonic() - t0 < client.timeout + 0.5
        t0 = time.monotonic()
        assert client.lookup(tokens) == 0
        assert time.monotonic() - t0 < 0.3, "a down daemon should fail fast after the first miss"
        strict = kvd_client.KvdClient(runtime_dir=str(rd), timeout=0.5, raise_errors=True)
        with pytest.raises(kvd_client.TransportError):
            strict.connect()
        strict.close()
        # A new daemon on the same runtime dir: the same client object comes back by itself.
        d2 = start_daemon(runtime_dir=rd)
        assert arenas(d2) == arena and "host tier adopted: 4 chunks" in d2.log(), d2.log()
        wait_for(lambda: client.lookup(tokens) == 64, 10, "the client to re-register")
        assert client.store(tokens, np.arange(16)) == 64
        assert client.load(tokens, np.arange(16, 32)) == 64
        assert same_pages(pool, slice(0, 16), slice(16, 32))
        stats = d2.stats()
        assert stats["clients"] == 1 and stats["registrations"] == 1, (stats, d2.log())
        assert stats["store_dedup"] == 4 and stats["tiers"]["host"]["warm"]["start"] == "clean"
    finally:
        client.close()
        pool.close()
    assert d2.stop() == 0


# ---- (b) daemon crash: stale sockets are reclaimed, the host tier adopted ---------

def test_crashed_daemon_leftovers_are_reclaimed(start_daemon, procs):
    d1 = start_daemon()
    rd = d1.runtime_dir
    client = kvd_client.KvdClient(runtime_dir=str(rd), timeout=1.0, raise_errors=False).connect()
    pool = random_pool(41)
    tokens = np.arange(64)
    try:
        client.register_kv(pool, model="crash")
        assert client.store(tokens, np.arange(16)) == 64
        wait_for(lambda: d1.stats()["tiers"]["host"]["warm"]["records_pending"] == 0, 10,
                 "the chunks' records (warm_record_delay_s)")
        old_pid = d1.proc.pid
        d1.kill()
        assert d1.proc.returncode == -signal.SIGKILL
        kept = arenas(d1)
        assert [p.name for p in kept] == [f"kvd-arena-{instance_tag(rd)}",
                                          f"kvd-arena-{instance_tag(rd)}.index"]
        legacy = Path("/dev/shm") / f"kvd-arena-{instance_tag(rd)}-{old_pid}"
        legacy.write_bytes(bytes(4096))  # what a release before warm restart left
        assert (rd / "kvd.sock").exists() and (rd / "control.sock").exists()
        assert client.lookup(tokens) == 0
        d2 = start_daemon(runtime_dir=rd)
        assert arenas(d2) == kept
        log = d2.log()
        for leftover in (rd / "kvd.sock", rd / "control.sock", legacy):
            assert f"reclaimed stale {leftover}" in log, log
        assert f"host tier adopted: 4 chunks (8KiB) after a crash of pid {old_pid}" in log, log
        assert procs.apply(W.roundtrip, (str(rd), 7)) is True
        wait_for(lambda: client.store(tokens, np.arange(16)) == 64, 10, "the client to re-register")
        assert client.load(tokens, np.arange(16, 32)) == 64
        assert same_pages(pool, slice(0, 16), slice(16, 32))
    finally:
        client.close()
        pool.close()
    assert d2.stop() == 0
    assert arenas(d2) == kept


# ---- (c) one daemon per runtime dir ----------------------------------------------

def test_second_daemon_on_same_runtime_dir_refuses(daemon, procs):
    rd = daemon.runtime_dir
    arena = arenas(daemon)
    second = subprocess.run([sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(rd),
                             "--host-capacity", "64MiB", "--chunk-tokens", "16"],
                            capture_output=True, text=True, timeout=60, env=clean_env())
    assert second.returncode not in (0, None)
    out = second.stdout + second.stderr
    assert f"another kvd (pid {daemon.proc.pid}) is serving {rd}" in out, out
    # The first one keeps serving, with its sockets and arena untouched.
    assert daemon.proc.poll() is None
    assert (rd / "kvd.sock").exists() and (rd / "control.sock").exists()
    assert arenas(daemon) == arena
    assert daemon.control("health")["pid"] == daemon.proc.pid
    assert procs.apply(W.roundtrip, (str(rd), 8)) is True


# ---- (d) bad configuration ----------------------------------------------------------

def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    env.update(extra)
    return env


def _serve_config(args: list, tmp_path: Path, **env):
    rd = tmp_path / "rd"
    p = subprocess.Popen([sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(rd), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=clean_env(**env))
    return p, rd


def test_bad_config_exits_2_naming_the_key(tmp_path):
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('host_capacity = "64MiB"\nbogus_knob = 1\n')
    bad_value = tmp_path / "bad_value.toml"
    bad_value.write_text("chunk_tokens = 16\nmax_clients = \"lots\"\n")
    not_toml = tmp_path / "not.toml"
    not_toml.write_text("host_capacity = = 3\n")
    cases = [
        (["--host-capacity", "abc"], {}, "host_capacity"),
        (["--host-capacity", "1KiB"], {}, "host_capacity"),
        (["--chunk-tokens", "0"], {}, "chunk_tokens"),
        (["--chunk-tokens", "1.5"], {}, "chunk_tokens"),
        (["--client-timeout-s", "soon"], {}, "client_timeout_s"),
        (["--heartbeat-interval-s", "5", "--client-timeout-s", "2"], {}, "client_timeout_s"),
        (["--log-level", "loud"], {}, "log_level"),
        ([], {"KVD_HOST_CAPACITY": "abc"}, "host_capacity"),
        ([], {"KVD_MAX_KEYS_PER_REQUEST": "-3"}, "max_keys_per_request"),
        (["--config", str(unknown)], {}, "bogus_knob"),
        (["--config", str(bad_value)], {}, "max_clients"),
        (["--config", str(not_toml)], {}, "config"),
        (["--config", str(tmp_path / "missing.toml")], {}, "config"),
    ]
    started = [(_serve_config(args, tmp_path / f"c{i}", **env), key)
               for i, (args, env, key) in enumerate(cases)]
    for ((p, rd), key), (args, env, _) in zip(started, cases):
        out, err = p.communicate(timeout=60)
        lines = err.strip().splitlines()
        assert p.returncode == 2, (args, env, p.returncode, err)
        assert len(lines) == 1, (args, env, err)
        assert lines[0].startswith(f"kvd: config error: {key}:"), (args, env, err)
        assert out == ""
        assert not (rd / "kvd.sock").exists()
