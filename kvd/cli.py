"""The ``kvd`` command: serve, stats, ctl, health, config, bench.

Every subcommand resolves the runtime dir the same way (``--runtime-dir``,
then the environment; see kvd_protocol.runtime). ``serve`` takes one flag per
config knob (``--host-capacity 8GiB``); a bad value exits with status 2
and one line naming the key. Operator commands talk to ``control.sock``
with a timeout and exit 1 when the daemon does not answer.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvd.config import KNOBS, load_config
from kvd_protocol.errors import ConfigError, KvdError


def _add_runtime(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime-dir", default=None, help="runtime directory of the daemon")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", description="kvd: a KV-cache daemon for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", default=None, help="TOML file of config knobs (see configs/kvd.toml)")
    for knob in KNOBS:
        serve.add_argument(f"--{knob.name.replace('_', '-')}", dest=knob.name, default=None,
                           metavar=knob.kind.upper(), help=f"{knob.help} (default: {knob.default!r})")
    stats = sub.add_parser("stats", help="print cache statistics")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_runtime(stats)
    health = sub.add_parser("health", help="exit 0 when the daemon is serving")
    _add_runtime(health)
    ctl = sub.add_parser("ctl", help="operator actions")
    ctl.add_argument("action", choices=["clear", "flush-disk", "clear-disk"],
                     help="clear: drop every host-tier chunk not in use; flush-disk: copy every "
                     "host chunk to the disk tier and wait until its write queue is empty; "
                     "clear-disk: delete every disk-tier chunk not being read")
    _add_runtime(ctl)
    cfg = sub.add_parser("config", help="print the default config file (TOML, commented)")
    cfg.add_argument("--defaults", action="store_true", help="(the only mode for now)")
    top = sub.add_parser("top", help="live view: hit rate, GB/s, latencies, tier fill, clients")
    from kvd.top import add_arguments as add_top_arguments
    add_top_arguments(top)
    _add_runtime(top)
    bench = sub.add_parser("bench", help="benchmark store/load through a private daemon")
    from kvd.bench import add_arguments
    add_arguments(bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "config":
        print(default_config_toml(), end="")
        return 0
    if args.command == "bench":
        from kvd.bench import run
        return run(args)
    if args.command == "top":
        from kvd.top import run as run_top
        return run_top(args)
    return _control(args)


def _serve(args) -> int:
    overrides = {k.name: getattr(args, k.name) for k in KNOBS}
    try:
        cfg = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"kvd: config error: {exc}", file=sys.stderr)
        return 2
    from kvd.server.daemon import serve
    return serve(cfg)


def _control(args) -> int:
    from kvd_client.transport import Channel
    from kvd_protocol.runtime import control_endpoint, resolve_runtime_dir
    action = (getattr(args, "action", None) or "").replace("-", "_")
    op = {"stats": "stats", "health": "health", "ctl": action}[args.command]
    channel = Channel(control_endpoint(resolve_runtime_dir(args.runtime_dir)), args.timeout)
    try:
        result = channel.request(op)
    except KvdError as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    if args.command == "stats" and not args.json:
        print(format_stats(result))
    elif args.command == "health":
        print(f"ok: pid {result['pid']}, backend {result['backend']}, up {result['uptime_s']} s")
    else:
        print(json.dumps(result, indent=2, default=lambda b: b.hex()))
    return 0


def format_stats(s: dict) -> str:
    lines = [f"{'tier':<8}{'capacity':>14}{'used':>14}{'chunks':>10}{'evictions':>11}"]
    for name, t in s["tiers"].items():
        lines.append(f"{name:<8}{_size(t['capacity_bytes']):>14}{_size(t['used_bytes']):>14}"
                     f"{t['chunks']:>10}{t['evictions']:>11}")
    disk = s["tiers"].get("disk")
    if disk:
        lines.append(f"disk: demotions {disk['demotions']} (dropped {disk['demotions_dropped']}, "
                     f"failed {disk['demotions_failed']})  promotions {disk['promotions']}  "
                     f"write {disk['write_gbps']} GB/s  read {disk['read_gbps']} GB/s  "
                     f"checksum failures {disk['checksum_failures']}  io errors {disk['io_errors']}  "
                     f"recovery {disk['recovery']['state']} ({disk['recovery']['chunks']} chunks)")
        gds = disk.get("gds")
        if gds:
            lines.append(f"gds: {gds['mode']}  loads {gds['direct_loads']}  chunks "
                         f"{gds['direct_chunks']} ({_size(gds['direct_bytes'])})  fallbacks "
                         f"{gds['fallbacks']}")
    lines.append("")
    lines.append(f"hits {s['hits']}  misses {s['misses']}  hit rate {s['hit_rate']:.1%}  "
                 f"dedup {s['store_dedup']}")
    lines.append(f"stored {_size(s['bytes_stored'])} ({s['chunks_stored']} chunks)  "
                 f"loaded {_size(s['bytes_loaded'])} ({s['chunks_loaded']} chunks)")
    lines.append(f"clients {s['clients']}  registrations {s['registrations']}  leases {s['leases']}  "
                 f"errors {s['errors']}  uptime {s['uptime_s']} s  backend {s['backend']}")
    for c in s.get("sessions", []):
        cred = f", uid {c['uid']} gid {c['gid']}" if "uid" in c else ""
        lines.append(f"  {c['name']}: pid {c['pid']}{cred}")
    if s["latency"]:
        lines.append("")
        lines.append(f"{'op':<12}{'count':>10}{'p50 ms':>10}{'p99 ms':>10}")
        for op, lat in sorted(s["latency"].items()):
            lines.append(f"{op:<12}{lat['count']:>10}{lat['p50_ms']:>10.3f}{lat['p99_ms']:>10.3f}")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _size_text(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def default_config_toml() -> str:
    out = ["# kvd configuration. Every key is optional; shown with its default.",
           "# Precedence: defaults < this file (--config) < KVD_<KEY> env < command-line flags.", ""]
    for knob in KNOBS:
        out.append(f"# {knob.help}")
        out.append(f"# type: {knob.kind}" + (f", one of: {', '.join(knob.choices)}" if knob.choices else ""))
        value = knob.default
        if knob.kind == "size":
            out.append(f'{knob.name} = "{_size_text(value)}"')
        elif isinstance(value, str):
            out.append(f'{knob.name} = "{value}"')
        elif isinstance(value, bool):
            out.append(f"{knob.name} = {str(value).lower()}")
        else:
            out.append(f"{knob.name} = {value}")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
