"""``kvd stats|health|ctl``: one request to the daemon's control socket, printed.

``run(args)`` resolves the runtime dir (``--runtime-dir``, then the
environment: kvd_protocol.runtime), fails at once with one line saying
what to check when nothing listens there (no ``control.sock``, or a stale
one a dead daemon left), else sends the request with ``--timeout``. It
prints a human line or table (``--json``: the reply) and exits 0, or 1
when the daemon is not reachable. ``stats --watch SECONDS`` repeats until
Ctrl-C (exit 0).
"""

from __future__ import annotations

import errno
import socket
import sys
import time
from pathlib import Path

from kvd.cli.format import format_stats, summary, to_json
from kvd_protocol.errors import KvdError
from kvd_protocol.runtime import control_endpoint, resolve_runtime_dir

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
        result = channel.request(op)
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
