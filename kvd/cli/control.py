"""``kvd stats|health|ctl``: one request to the daemon's control socket, printed.

``run(args)`` resolves the runtime dir, fails at once with one line saying what to check
when nothing listens there, else sends the request with ``--timeout`` and prints a line or
table (``--json``: the reply). Exit 0, or 1 when the daemon is unreachable.
``stats --watch`` repeats until Ctrl-C. ``ctl flush-disk``/``clear-disk`` wait as long as
the disk takes and report progress on stderr; a timeout says the daemon goes on.
"""

from __future__ import annotations

import errno
import socket
import sys
import time
from pathlib import Path

from kvd.cli.format import format_stats, size, summary, to_json
from kvd_protocol.errors import KvdError, Timeout
from kvd_protocol.runtime import control_endpoint, resolve_runtime_dir

PROGRESS_AFTER_S = 2.0  # a flush done sooner prints nothing but its result
PROGRESS_EVERY_S = 2.0
WHERE = ("pass the daemon's --runtime-dir, or set KVD_RUNTIME_DIR (kvd serve logs its runtime "
         "dir when it starts)")


def run(args) -> int:
    runtime_dir = resolve_runtime_dir(args.runtime_dir)
    problem = unreachable(runtime_dir / "control.sock")
    if problem:
        print(f"kvd: {problem}", file=sys.stderr)
        return 1
    from kvd_client.transport import Channel
    channel = Channel(control_endpoint(runtime_dir), args.timeout)
    try:
        if args.command == "stats" and args.watch:
            return _watch(channel, args)
        op = {"stats": "stats", "health": "health", "ctl": (getattr(args, "action", None) or "")
              .replace("-", "_")}[args.command]
        result = _long(channel, op, args.timeout) if op in LONG_OPS else channel.request(op)
        if args.json:
            print(to_json(result))
        elif args.command == "stats":
            print(format_stats(result))
        else:
            print(summary(op, result))
        return 0
    except KvdError as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 1
    finally:
        channel.close()


LONG_OPS = ("flush_disk", "clear_disk")


def _long(channel, op: str, timeout: float) -> dict:
    """The reply to ``op``, waited for up to ``timeout`` s with progress lines on stderr."""
    name = op.replace("_", "-")
    t0 = time.monotonic()
    before = _disk(channel)
    req = channel.send(op)
    deadline, report = t0 + timeout, t0 + PROGRESS_AFTER_S
    while (now := time.monotonic()) < deadline:
        for rid, result, error in channel.collect(min(deadline, report) - now):
            if rid == req:
                if error is not None:
                    raise error
                return result
        if time.monotonic() >= report and before is not None:
            print(_progress(name, time.monotonic() - t0, before, _disk(channel)),
                  file=sys.stderr, flush=True)
            report += PROGRESS_EVERY_S
    channel.forget(req)
    raise Timeout(f"{name} did not finish within {timeout:g} s; the daemon goes on with it "
                  "(kvd stats shows the disk tier; --timeout SECONDS waits longer)")


def _disk(channel) -> dict | None:
    """The disk tier's stats (None without one); asking also shows the daemon is there."""
    return channel.request("stats", timeout=PROGRESS_EVERY_S + 3)["tiers"].get("disk")


def _progress(name: str, elapsed: float, before: dict, now: dict) -> str:
    if name == "clear-disk":
        return f"{name}: {elapsed:.0f} s, {now['chunks']} chunks left on disk"
    written = now["writes"] - before["writes"]
    done = now["write_bytes"] - before["write_bytes"]
    return (f"{name}: {elapsed:.0f} s, {written} chunks written ({size(done)}), "
            f"{now['queued_writes']} queued, {now['chunks']} chunks on disk")


def unreachable(sock: Path) -> str | None:
    """Why no daemon can answer at ``sock`` (checked without waiting), or None."""
    try:
        exists = sock.exists()
    except PermissionError:
        return f"cannot look into {sock.parent}: permission denied (run as the daemon's user or group)"
    if not exists:
        return (f"no kvd daemon at {sock.parent} ({sock.name} does not exist): is `kvd serve` "
                f"running? If it is, {WHERE}")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(sock))
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return (f"no kvd daemon listening at {sock} (a daemon that exited uncleanly left "
                    f"it): start `kvd serve`, or {WHERE}")
        if exc.errno == errno.EACCES:
            return f"cannot connect to {sock}: permission denied (run as the daemon's user or group)"
        return None  # let the request report anything else
    finally:
        probe.close()
    return None


def _watch(channel, args) -> int:
    tty = sys.stdout.isatty()
    try:
        while True:
            result = channel.request("stats")
            if args.json:
                print(to_json(result, indent=None), flush=True)
            else:
                if tty:
                    sys.stdout.write("\x1b[H\x1b[2J")  # top of a cleared screen
                print(f"{time.strftime('%H:%M:%S')}  every {args.watch:g} s (Ctrl-C stops)")
                print(format_stats(result) + ("" if tty else "\n"), flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
