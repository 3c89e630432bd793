"""Hits labelled by the tier they come from (vLLM 0.34's ``get_external_cache_hit_sources``).

The scheduler half runs against a real daemon (tests/vllm/halves.py): a hit
from the host tier is all ``host``; after the daemon restarted without its
host tier (``warm_restart`` off) and with its disk tier (written by ``kvd ctl
flush-disk``), the same prompt's
hit is all ``disk``, as the daemon's lookup reply counted it. The split itself
(host prefix, then disk, then the remote tier as ``p2p``, cut to the loaded
``[local, hit)``) is checked on made-up answers.
"""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

from halves import CHUNK, Engine, Request, store_prompt

from kvd_client.vllm.access import hit_sources


def test_split_follows_the_tiers_and_the_loaded_range():
    st = SimpleNamespace(local=0, hit=5 * CHUNK, found=5 * CHUNK, tiers=(2, 1))
    assert hit_sources(st, 5 * CHUNK, CHUNK) == {"host": 2 * CHUNK, "disk": 2 * CHUNK, "p2p": CHUNK}
    st = SimpleNamespace(local=CHUNK + 4, hit=4 * CHUNK, found=5 * CHUNK, tiers=(2, 1))
    assert hit_sources(st, 3 * CHUNK - 4, CHUNK) == {"host": CHUNK - 4, "disk": 2 * CHUNK}
    assert hit_sources(None, 7, CHUNK) == {"host": 7} and hit_sources(None, 0, CHUNK) == {}
    st = SimpleNamespace(local=0, hit=2 * CHUNK, found=2 * CHUNK, tiers=(0, 2))
    assert hit_sources(st, 2 * CHUNK, CHUNK) == {"p2p": 2 * CHUNK}
    assert hit_sources(st, CHUNK, CHUNK) == {"host": CHUNK}  # not the scheduler's hit: unsplit


def test_host_hits_then_disk_hits_after_a_cold_restart(start_daemon, tmp_path):
    knobs = {"chunk_tokens": CHUNK, "disk_dir": str(tmp_path / "disk"), "disk_capacity": "64MiB",
             "warm_restart": False}
    d = start_daemon(**knobs)
    tokens = list(range(100, 150))  # 3 whole chunks
    a = Engine(d.runtime_dir, "a")
    try:
        store_prompt(a, "r1", tokens, list(range(1, 14)))
        b = Engine(d.runtime_dir, "a")  # the same model: the same namespace
        try:
            req = Request("r2", tokens)
            assert b.sched.matched(req, 0) == (48, True)
            assert hit_sources(b.sched.reqs["r2"], 48, CHUNK) == {"host": 48}
        finally:
            b.close()
    finally:
        a.close()
    flushed = subprocess.run([sys.executable, "-m", "kvd", "ctl", "flush-disk", "--runtime-dir",
                              str(d.runtime_dir)], capture_output=True, text=True, timeout=60)
    assert flushed.returncode == 0, flushed.stderr
    assert d.stats()["tiers"]["disk"]["chunks"] == 3
    assert d.stop() == 0
    d2 = start_daemon(runtime_dir=d.runtime_dir, **knobs)
    deadline = time.monotonic() + 20
    while d2.stats()["tiers"]["disk"]["recovery"]["state"] != "done":
        assert time.monotonic() < deadline, d2.log()
        time.sleep(0.05)
    c = Engine(d2.runtime_dir, "a")
    try:
        req = Request("r3", tokens)
        assert c.sched.matched(req, 0) == (48, True)
        assert hit_sources(c.sched.reqs["r3"], 48, CHUNK) == {"disk": 48}
    finally:
        c.close()
