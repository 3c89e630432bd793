"""``kvd top`` against a real daemon with a real engine process making traffic.

Its output is not a terminal here, so it prints plain text: one view over
one interval (``--once``); on a pty without ``rich`` it says what to
install. The percentile arithmetic is checked on its own against
hand-computed histograms.
"""

from __future__ import annotations

import multiprocessing
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import workers_ops
from daemons import default_sigint

from kvd.cli.top import compute, quantile, render_text

SPEC = {"layout": "vllm_flash_attn", "layers": 2, "page_size": 16, "dtype": "float16",
        "num_pages": 16, "heads": 2, "dim": 8}


def test_renders_once_as_plain_text_while_an_engine_works(daemon, procs):
    with multiprocessing.get_context("spawn").Manager() as m:
        stop = m.Event()
        job = procs.apply_async(workers_ops.busy_engine, (str(daemon.runtime_dir), SPEC, 3, stop))
        try:
            deadline = time.monotonic() + 30
            while daemon.stats()["chunks_stored"] < 2:
                assert time.monotonic() < deadline, "the engine never stored"
                time.sleep(0.05)
            out = subprocess.run([sys.executable, "-m", "kvd", "top", "--once", "--interval", "1",
                                  "--runtime-dir", str(daemon.runtime_dir)],
                                 capture_output=True, text=True, timeout=30)
        finally:
            stop.set()
        assert job.get(30)["rounds"] > 0
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "\x1b[" not in text  # no terminal escapes when stdout is not a TTY
    assert re.search(r"hit rate 100\.0% \(\d+ hits, 0 misses\)", text), text
    rate_in, rate_out = map(float, re.search(r"in ([\d.]+) [kMG]B/s  out ([\d.]+) [kMG]B/s", text).groups())
    assert rate_in > 0 and rate_out > 0, text
    for op in ("lookup", "store", "load"):
        rate, p50, p99 = re.search(rf"^{op}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", text, re.M).groups()
        assert float(rate) > 0 and 0 < float(p50) <= float(p99), text
    assert re.search(r"^host\s+[\d.]+ [KM]iB / 64\.0 MiB\s+[\d.]+%\s+\d+$", text, re.M), text
    assert re.search(r"^kvd_client:\d+\s+\d+\s+0\s+0\s+1\s+0$", text, re.M), text  # root's engine
    busy = int(re.search(r"  loop (\d+)%$", text, re.M).group(1))
    assert 0 < busy <= 105, text  # the loop served the engine; its CPU over ~1 s of wall time


def test_loop_busy_is_the_loop_cpu_over_the_interval():
    """The summary's ``loop``: the daemon's ``loop_cpu_s`` delta over the interval; ``-``
    from a daemon that does not report it."""
    def stats(loop_cpu=None):
        out = {"hits": 0, "misses": 0, "uptime_s": 9.0, "backend": "shm", "bytes_stored": 0,
               "bytes_loaded": 0, "errors": 0, "tiers": {}, "clients": 0}
        return out if loop_cpu is None else {**out, "loop_cpu_s": loop_cpu}
    view = compute(stats(1.0), stats(1.75), 2.0, {"pid": 7})
    assert view["loop_busy"] == 0.375
    assert render_text(view).splitlines()[1].endswith("clients 0  loop 38%")
    assert render_text(compute(stats(), stats(), 2.0, {})).splitlines()[1].endswith("loop -")


def test_quantile_interpolates_within_the_bucket_like_prometheus():
    bounds = [0.001, 0.01, 0.1]
    assert quantile(bounds, [0, 0, 0, 0], 0.5) is None
    assert quantile(bounds, [10, 0, 0, 0], 0.5) == 0.0005      # half way into [0, 1 ms]
    assert abs(quantile(bounds, [0, 4, 0, 0], 0.25) - 0.00325) < 1e-12  # a quarter into (1, 10] ms
    assert quantile(bounds, [1, 0, 0, 99], 0.99) == 0.1        # in +Inf: the largest finite bound
    assert abs(quantile(bounds, [50, 50, 0, 0], 0.99) - (0.001 + 0.009 * 49 / 50)) < 1e-12


def test_on_a_terminal_without_rich_it_says_what_to_install(daemon, tmp_path):
    """stdout a terminal (a pty), ``rich`` not importable: one line on stderr naming
    what to install, then the plain views."""
    (tmp_path / "rich").mkdir()
    (tmp_path / "rich" / "__init__.py").write_text("raise ImportError('hidden')\n")
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvd", "top", "--interval", "0.2",
                             "--runtime-dir", str(daemon.runtime_dir)], stdout=follower,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    os.close(follower)
    try:
        seen = b""
        while b"hit rate" not in seen:
            assert select.select([leader], [], [], 30)[0], "no view on the terminal"
            seen += os.read(leader, 65536)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    assert proc.returncode == 0
    assert err == ("kvd top: rich is not installed: plain text, one view per refresh (pip install "
                   "rich for the live view)\n")
