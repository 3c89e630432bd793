"""The host tier a stopped daemon keeps in /dev/shm, from the operator's side.

A daemon that stops says how large the tier it keeps is and which command
frees it; ``kvd drop-tier`` refuses while the daemon serves, frees the
memory once it has stopped (saying how much), and says so when there is
nothing to free. ``kvd bench --flood``'s private daemon leaves no tier
behind (the runtime dirs of the bench's daemons are found as they appear:
they are temporary directories under the bench's TMPDIR).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from shm_files import arena_files


def kvd(*args, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_drop_tier_frees_a_stopped_daemons_tier_and_refuses_a_running_one(start_daemon):
    d = start_daemon()
    rd = d.runtime_dir
    busy = kvd("drop-tier", "--runtime-dir", rd)
    assert busy.returncode == 1 and f"(pid {d.proc.pid}) is serving {rd}" in busy.stderr
    assert busy.stderr.count("\n") == 1 and len(arena_files(rd)) == 2
    assert d.stop() == 0
    kept = arena_files(rd)
    assert len(kept) == 2
    hint = (f"the host tier (64MiB) stays in /dev/shm for a warm restart; `kvd drop-tier "
            f"--runtime-dir {rd}` frees it")
    assert d.log().rstrip().splitlines()[-2].endswith(hint), d.log()
    out = kvd("drop-tier", "--runtime-dir", rd)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(rf"drop-tier: freed 64\.\d MiB of /dev/shm: the host tier of {rd} "
                        rf"\({kept[0].name}, {kept[1].name}\)\n", out.stdout), out.stdout
    assert arena_files(rd) == []
    again = kvd("drop-tier", "--runtime-dir", rd)
    assert again.returncode == 0 and again.stdout == (f"drop-tier: no host tier of {rd} in "
                                                      "/dev/shm: nothing to free\n")


def test_bench_flood_leaves_no_host_tier(tmp_path):
    """Its daemon used to be stopped without removing the tier it kept (1 GiB of /dev/shm)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvd", "bench", "--flood", "--repeat", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    rundirs = set()
    try:
        while proc.poll() is None:
            rundirs |= {p for p in tmp_path.glob("kvd-*") if p.is_dir()}
            time.sleep(0.01)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert rundirs, "the bench's runtime dir was not seen"
    left = [p for rd in rundirs for p in arena_files(rd)]
    for path in left:
        path.unlink()
    assert left == []
