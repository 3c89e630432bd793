"""The ``kvd`` command: serve, stats, health, ctl, config, top, bench, drop-tier.

``main(argv)`` parses (kvd.cli.parser: a typo'd flag gets the usage and the closest flag,
exit 2) and runs one subcommand: ``serve`` (resolve the config, run kvd.server.daemon until
SIGTERM/SIGINT), ``stats``/``health``/``ctl`` (kvd.cli.control), ``config`` (defaults, or
``--resolved`` with sources), ``top``, ``bench``, ``drop-tier``.
Promises: a bad key or value is one line naming it and exit status 2; unknown ``KVD_*``
variables get one warning line each, naming the closest knob. Never: a traceback for bad input.
"""

from __future__ import annotations

import os
import sys

# Only ``os`` and ``sys`` at import time: ``kvd`` (the console script) imports this module before
# calling main(), and a Ctrl-C during the heavier imports below must be main()'s to handle.


def main(argv=None) -> int:
    try:
        if (sys.argv[1:] if argv is None else list(argv))[:1] == ["serve"]:
            from kvd.server.early_signals import record
            record()  # before the heavy imports: see kvd.server.early_signals
        return _main(argv)
    except KeyboardInterrupt:  # outside the daemon's own handlers: imports, bench, exit
        print("kvd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvd stats | head -2`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0


def _main(argv) -> int:
    from kvd.cli.parser import parse
    args = parse(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "config":
        return _config(args)
    if args.command == "bench":
        from kvd.bench import run
        return run(args)
    if args.command == "drop-tier":
        from kvd.cli.drop_tier import run as run_drop
        return run_drop(args)
    if args.command == "top":
        from kvd.cli.top import run as run_top
        return run_top(args)
    from kvd.cli.control import run
    return run(args)


def _serve(args) -> int:
    from kvd.config import KNOBS, load_config
    from kvd_protocol.errors import ConfigError
    overrides = {k.name: getattr(args, k.name) for k in KNOBS}
    try:
        cfg = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"kvd: config error: {exc}", file=sys.stderr)
        return 2
    from kvd.server.daemon import serve
    from kvd.server.early_signals import pending
    if pending() is not None:
        print(f"kvd: stopped by {pending().name} before start-up", file=sys.stderr)
        return 0
    code = serve(cfg)
    # Stopped: a second Ctrl-C (or SIGTERM) is a repeat of the first. Ignored, it cannot end the
    # interpreter's own exit by signal (status 130): Python resets the handlers it set to the
    # default action as it finalizes, and leaves ignored ones ignored.
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return code


def _config(args) -> int:
    from kvd.config import defaults_toml, load_config, resolved_toml
    from kvd.config_env import print_warnings
    from kvd_protocol.errors import ConfigError
    if not args.resolved:
        print(defaults_toml(), end="")
        return 0
    try:
        print(_with_runtime_dir(resolved_toml(load_config(args.config))), end="")
        print_warnings()
    except ConfigError as exc:
        print(f"kvd: config error: {exc}", file=sys.stderr)
        return 2
    return 0


def _with_runtime_dir(text: str) -> str:
    """An empty runtime_dir means "by the rules": say which directory they give here."""
    from kvd_protocol.runtime import resolve_runtime_dir
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith('runtime_dir = ""  # '):
            lines[i] = f"{line.rstrip()}: {resolve_runtime_dir()} here\n"
    return "".join(lines)


if __name__ == "__main__":
    sys.exit(main())
