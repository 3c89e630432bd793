"""The ``kvd`` command line: one parser, ``serve``'s flags from the knob table, typo hints.

``build_parser()`` builds ``kvd`` (with ``--version``) and its subcommands.
``serve`` has one flag per config knob; its help shows the default as a
person writes it (``1GiB``, ``true``/``false``) and the knob's choices.
``parse(argv)`` parses like argparse, except that an unknown flag is
reported by the subcommand it was given to (that subcommand's usage, exit
status 2) with the closest flag it has: ``did you mean --host-capacity?``
(what Python 3.14's ``suggest_on_error`` does, built on difflib). Flags are
never abbreviated: ``--chunk-token`` is a typo, not ``--chunk-tokens``
(knob names share prefixes, and a script should say what it means).
"""

from __future__ import annotations

import argparse
import difflib

from kvd import __version__
from kvd.config import KNOBS, display_value
from kvd_protocol import wire


def version_text() -> str:
    return f"kvd {__version__} (wire protocol v{wire.VERSION})"


def _metavar(knob) -> str:
    if knob.choices:
        return "{" + ",".join(knob.choices) + "}"
    if knob.kind == "bool":
        return "{true,false}"
    if knob.kind == "str":
        return "PATH" if knob.name.endswith("_dir") else "TEXT"
    if knob.kind == "float":
        return "SECONDS" if knob.name.endswith("_s") else "NUMBER"
    return {"size": "SIZE", "int": "N", "quotas": "TOML"}[knob.kind]


def _add_serve(sub) -> argparse.ArgumentParser:
    serve = sub.add_parser("serve", help="run the daemon in the foreground", allow_abbrev=False,
                           usage="kvd serve [--config FILE] [--KNOB VALUE ...] [--cold]",
                           formatter_class=_OneLineFlags,
                           description="Run the daemon in the foreground. Every flag below is a "
                           "config knob, shown with its default: `kvd config` prints each knob's "
                           "help, docs/config.md has them as a table. Sizes take KiB/MiB/GiB/TiB "
                           "(powers of 1024) or KB/MB/GB/TB (powers of 1000).")
    serve.add_argument("--config", default=None, metavar="FILE",
                       help="TOML file of config knobs (see configs/kvd.toml)")
    for knob in KNOBS:
        text = f"default: {display_value(knob, knob.default)}"
        serve.add_argument(f"--{knob.name.replace('_', '-')}", dest=knob.name, default=None,
                           metavar=_metavar(knob), help=text.replace("%", "%%"))
    serve.add_argument("--cold", dest="cold_start", action="store_const", const="true",
                       help="start with an empty host tier (the same as --cold-start true)")
    return serve


class _OneLineFlags(argparse.HelpFormatter):
    """``serve --help``: each knob's flag and default on one line (70 knobs' whole help is
    some 380 lines; ``kvd config`` has it)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=50, width=100)


def _add_runtime(p: argparse.ArgumentParser, json_help: str) -> None:
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument("--runtime-dir", default=None, metavar="PATH",
                   help="runtime directory of the daemon (default: $KVD_RUNTIME_DIR, then the "
                   "rules of docs/config.md)")
    p.add_argument("--timeout", type=_positive, default=None, metavar="SECONDS",
                   help="seconds to wait for the daemon's answer (default: 5; ctl flush-disk and "
                   f"clear-disk: {LONG_TIMEOUT_S:g}, as they wait for the disk)")


# flush-disk and clear-disk answer once the disk is done: a tier of GiBs takes seconds to minutes
LONG_TIMEOUT_S = 600.0
LONG_ACTIONS = ("flush-disk", "clear-disk")


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", allow_abbrev=False,
                                     description="kvd: a KV-cache daemon for LLM inference")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {"serve": _add_serve(sub)}
    stats = commands["stats"] = sub.add_parser("stats", help="print cache statistics",
                                                     allow_abbrev=False)
    _add_runtime(stats, "print JSON instead of a table (with --watch: one object per line)")
    stats.add_argument("--watch", type=_positive, default=None, metavar="SECONDS",
                       help="print them again every SECONDS until Ctrl-C")
    health = commands["health"] = sub.add_parser("health", allow_abbrev=False,
                                                        help="exit 0 when the daemon is serving")
    _add_runtime(health, "print the reply as JSON")
    ctl = commands["ctl"] = sub.add_parser("ctl", help="operator actions", allow_abbrev=False)
    ctl.add_argument("action", choices=["clear", *LONG_ACTIONS],
                     help="clear: drop every host-tier chunk not in use; flush-disk: copy every "
                     "host chunk to the disk tier (whatever disk_min_hits says) and wait until "
                     "its write queue is empty, with a progress line on stderr every few seconds; "
                     "clear-disk: delete every disk-tier chunk not being read")
    _add_runtime(ctl, "print the reply as JSON instead of one line")
    cfg = commands["config"] = sub.add_parser(
        "config", help="print the default config file (TOML, commented)", allow_abbrev=False,
        description="Print the default config file (configs/kvd.toml). With --resolved: the "
        "config kvd serve would run with here (defaults < --config FILE < KVD_<KEY> "
        "environment), each value with where it came from.")
    cfg.add_argument("--resolved", action="store_true",
                     help="print the resolved config with each value's source")
    cfg.add_argument("--config", default=None, metavar="FILE",
                     help="with --resolved: the TOML file kvd serve would be given")
    drop = commands["drop-tier"] = sub.add_parser(
        "drop-tier", allow_abbrev=False,
        help="free the host tier a stopped daemon keeps in shm_dir for a warm restart",
        description="Delete the host tier a stopped daemon kept in shm_dir for the next start "
        "(warm restart), freeing its memory. Refused while a daemon serves that runtime dir.")
    drop.add_argument("--runtime-dir", default=None, metavar="PATH",
                      help="runtime directory of the daemon (default: as kvd serve resolves it)")
    drop.add_argument("--shm-dir", default=None, metavar="PATH",
                      help="where the daemon kept it (default: shm_dir as kvd serve resolves it)")
    drop.add_argument("--config", default=None, metavar="FILE",
                      help="the TOML file kvd serve was given (for its runtime_dir and shm_dir)")
    top = commands["top"] = sub.add_parser(
        "top", help="live view: hit rate, GB/s, latencies, tier fill, clients", allow_abbrev=False)
    from kvd.cli.top import add_arguments as add_top_arguments
    add_top_arguments(top)
    _add_runtime(top, "(unused: top prints for people; use kvd stats --json for machines)")
    bench = commands["bench"] = sub.add_parser(
        "bench", help="benchmark store/load through a private daemon it starts itself",
        allow_abbrev=False, usage="kvd bench [--gpu|--disk|--gds|--remote|--restart|--flood|"
        "--disk-policy] [OPTIONS] (kvd bench --help lists them)",
        description="Benchmarks. Each starts its own private kvd daemon on a temporary runtime "
        "dir and stops it at the end: no running daemon is needed or touched.")
    from kvd.bench import add_arguments
    add_arguments(bench)
    parser.set_defaults(commands=commands)
    return parser


def _unknown_message(sub: argparse.ArgumentParser, extra: list) -> str:
    flags = [flag for flag in sub._option_string_actions if flag.startswith("--")]
    msg = f"unrecognized arguments: {' '.join(extra)}"
    for word in extra:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.6)
            if close:
                msg += f" (did you mean {close[0]}?)"
    return msg


def parse(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = args.commands[args.command]
        sub.error(_unknown_message(sub, extra))
    if args.command == "config" and args.config and not args.resolved:
        args.commands["config"].error("--config needs --resolved")
    if getattr(args, "timeout", 0) is None:
        args.timeout = LONG_TIMEOUT_S if getattr(args, "action", None) in LONG_ACTIONS else 5.0
    return args
