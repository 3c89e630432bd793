"""What the benchmarks share: the private daemon, control requests, geometry.

``start_daemon``/``stop_daemon`` run ``kvd serve`` in a subprocess on a runtime dir and
stop it again, removing the host tier it keeps (nothing is left in /dev/shm); ``control``
sends one control request; ``request_bytes`` sizes a request; ``start_scraper`` polls
``/metrics`` from another process; ``without_gpu_stack`` says what to install;
``on_stream`` runs an engine's calls on its own CUDA stream; ``page_sets`` picks pages.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

PAGE_ORDERS = ("random", "sorted", "contiguous")


def page_sets(order: str, n: int, seed: int):
    """Two disjoint sets of ``n`` page ids out of ``2 n``, as int64 arrays: ``random``, a
    random permutation split in two (an engine's free list after much churn: pages of
    one chunk adjacent only by chance, one copy each; the worst case and the default);
    ``sorted``, the same sets each in ascending order (a free list kept sorted, as
    SGLang's paged allocator with ``need_sort``: about half of neighbours adjacent);
    ``contiguous``, ``[0, n)`` and ``[n, 2 n)`` (a fresh engine's free list: a chunk's
    pages are one run, one copy per layer)."""
    import numpy as np
    if order not in PAGE_ORDERS:
        raise ValueError(f"page order must be one of {', '.join(PAGE_ORDERS)}, got {order!r}")
    ids = np.arange(2 * n) if order == "contiguous" else np.random.default_rng(seed).permutation(2 * n)
    a, b = ids[:n], ids[n:]
    if order == "sorted":
        a, b = np.sort(a), np.sort(b)
    return a.astype(np.int64), b.astype(np.int64)


def control(rundir: str, op: str, timeout: float = 300.0):
    """One control-socket request (``stats``, ``clear``, ``flush_disk``...) to the private daemon."""
    from kvd_client.transport import Channel
    from kvd_protocol.runtime import control_endpoint

    ch = Channel(control_endpoint(Path(rundir)), timeout)
    try:
        return ch.request(op)
    finally:
        ch.close()


_PIP = {"torch": "torch", "cupy": "cupy-cuda13x", "kvikio": "kvikio-cu13"}  # module: what installs it
_NAMES = {"torch": "PyTorch", "cupy": "CuPy", "kvikio": "KvikIO"}


def without_gpu_stack(flag: str, modules=("torch", "cupy")) -> bool:
    """Whether one of ``modules`` is missing (looked up, not imported); if so, one line on
    stderr naming what to ``pip install``."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return False
    pkgs = dict.fromkeys(_PIP[m] for m in missing)
    if _PIP["kvikio"] in pkgs:
        pkgs.pop(_PIP["cupy"], None)  # kvikio-cu13 brings CuPy too
    names = [_NAMES[m] for m in missing]
    names = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
    print(f"kvd bench {flag} needs {names}, not installed here: pip install {' '.join(pkgs)} "
          "(and a CUDA GPU)", file=sys.stderr)
    return True


class BenchError(RuntimeError):
    """A benchmark that cannot run here (its daemon did not start, say): ``kvd bench`` prints
    the message as one line and exits 1."""


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1, else a usage error (exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def size_arg(text: str) -> int:
    """An argparse type: a size such as '4GiB', else a usage error (exit status 2) that
    says why (kvd.config.parse_size's message)."""
    from kvd.config import parse_size
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def start_daemon(rundir: str, capacity: int, chunk_tokens: int, extra=(),
                  log_path: str | None = None, profile: str | None = None) -> subprocess.Popen:
    """The private daemon; with ``log_path`` it logs at debug level into that file, with
    ``profile`` it runs under cProfile, which writes its stats there when it stops."""
    level = "debug" if log_path else "warning"
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    cmd = [sys.executable, *prof, "-m", "kvd", "serve", "--runtime-dir", rundir, "--host-capacity",
           str(capacity), "--chunk-tokens", str(chunk_tokens), "--log-level", level, *extra]
    log = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    deadline = time.monotonic() + 60
    try:
        while not os.path.exists(os.path.join(rundir, "control.sock")):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError("the benchmark daemon did not start (its log line above says why)")
            time.sleep(0.05)
    except BaseException:  # Ctrl-C too: no daemon and no host tier left behind
        stop_daemon(proc, rundir)
        raise
    return proc


def stop_daemon(proc: subprocess.Popen, rundir: str, timeout: float = 60.0,
                shm_dir: str = "/dev/shm") -> None:
    """SIGTERM the private daemon, wait for it, remove the host tier it kept."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout)
    finally:
        remove_host_tier(rundir, shm_dir)


def remove_host_tier(rundir: str, shm_dir: str = "/dev/shm") -> None:
    """Delete the host tier (arena and index) the daemons of ``rundir`` keep across restarts."""
    from kvd.tiers.host.arena_index import kept_files
    from kvd_protocol.runtime import instance_tag

    for path in kept_files(Path(shm_dir), instance_tag(Path(rundir))):
        path.unlink(missing_ok=True)


def request_bytes(shape, chunks: int, chunk: int) -> int:
    """Bytes of one request of ``chunks`` chunks of a (layout, layers, kv_heads, head_dim)
    shape in a 2-byte dtype."""
    layout, layers, heads, dim = shape
    planes = 1 if layout.endswith("mla") or layout == "opaque" else 2
    return layers * planes * chunk * heads * dim * 2 * chunks


SCRAPER = """
import signal, sys, time, urllib.request
url, period, n = sys.argv[1], 1.0 / float(sys.argv[2]), 0
def stop(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, stop)
try:
    while True:
        t = time.monotonic()
        try:
            urllib.request.urlopen(url, timeout=5).read()
            n += 1
        except OSError:
            pass
        time.sleep(max(0.0, period - (time.monotonic() - t)))
except KeyboardInterrupt:
    print(n)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_scraper(port: int, hz: float) -> subprocess.Popen:
    """A process fetching http://127.0.0.1:<port>/metrics ``hz`` times a second; on SIGTERM it
    prints how many scrapes succeeded."""
    return subprocess.Popen([sys.executable, "-c", SCRAPER, f"http://127.0.0.1:{port}/metrics",
                             str(hz)], stdout=subprocess.PIPE, text=True)


def on_stream(torch, stream, call, *args):
    """``call(*args)`` with ``stream`` as this thread's current CUDA stream, then wait for
    it. The benchmarks' engines are threads of one process; engines in production are
    processes with streams of their own, and on one shared stream a store's mark would
    wait behind another engine's load."""
    with torch.cuda.stream(stream):
        out = call(*args)
    stream.synchronize()
    return out


def write_json(path: str, **parts) -> None:
    """The benchmark's results as JSON at ``path`` (numpy numbers as plain ones), with the
    command that produced them."""
    import json

    from .plot import command  # no matplotlib needed for it

    def plain(value):
        if hasattr(value, "tolist"):
            return value.tolist()
        raise TypeError(f"cannot write {type(value).__name__} as JSON")

    doc = {"command": command(), **parts}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=plain)
        f.write("\n")
