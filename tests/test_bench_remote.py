"""``kvd bench --remote`` end to end at a tiny size, as a user runs it: real stores on loopback
(redis-server, mooncake_master), kvd's remote tier with a checksum process, the store's own
clients, then the half-local, half-remote load through real daemons. It checks that every side
moved every chunk and reported a rate, that the JSON holds each run, and that the bench's
shared-memory arena and its checksum process are gone after it (the suite's shm check). It
asserts nothing about speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvd.bench.remote import MATCH, SIDES
from kvd.bench.stores import MooncakeMaster, RedisServer


def test_the_remote_bench_runs_every_side_of_both_stores(tmp_path):
    for server in (RedisServer, MooncakeMaster):
        why = server.missing()
        if why:
            pytest.skip(f"{server.what}: {why}")
    out = tmp_path / "remote.json"
    run = subprocess.run(
        [sys.executable, "-m", "kvd", "bench", "--remote", "--remote-chunks", "4",
         "--remote-chunk-mib", "0.25", "--remote-threads", "2", "--remote-digest-processes", "1",
         "--repeat", "2", "--layers", "2", "--chunks", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "checksums in 1 processes" in run.stdout
    moves = json.loads(out.read_text())["remote"]["moves_gbps"]
    for store, sides in SIDES.items():
        for side in sides:
            for d in ("put", "get"):
                runs = moves[store][f"{side} {d}"]
                assert len(runs) == 2 and all(r > 0 for r in runs), (store, side, d, runs)
        for m in MATCH[store]:
            assert f"kvd/{m}" in run.stdout
    assert "mixed / sum" in run.stdout
