"""``kvd drop-tier``: free the host tier a stopped daemon keeps in shm_dir for a warm restart.

``run(args)`` finds the runtime dir and shm_dir as ``kvd serve`` would, takes the runtime
dir's lock so no daemon adopts the tier meanwhile, deletes ``kvd-arena-<tag>`` and its
``.index`` (and stale pid-named arenas), and prints what it freed (exit 0, also when
nothing was there). Never deletes while a daemon holds the lock: one line, exit 1
(``kvd ctl clear`` empties a running daemon's tier).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvd.cli.format import size


def run(args) -> int:
    from kvd.config import load_config
    from kvd.config_env import print_warnings
    from kvd.server.kept_tier import drop
    from kvd.server.runtime_dir import InstanceBusy
    from kvd_protocol.errors import ConfigError
    from kvd_protocol.runtime import resolve_runtime_dir
    try:
        cfg = load_config(args.config, overrides={"runtime_dir": args.runtime_dir,
                                                  "shm_dir": args.shm_dir})
    except ConfigError as exc:
        print(f"kvd: config error: {exc}", file=sys.stderr)
        return 2
    print_warnings()
    runtime_dir = resolve_runtime_dir(cfg.runtime_dir or None)
    try:
        freed, removed = drop(Path(cfg.shm_dir), runtime_dir)
    except InstanceBusy as exc:
        print(f"kvd drop-tier: a kvd daemon (pid {exc.owner}) is serving {runtime_dir} with this "
              "host tier: stop it first (kvd ctl clear empties the tier of a running daemon)",
              file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvd drop-tier: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return 1
    if not removed:
        print(f"drop-tier: no host tier of {runtime_dir} in {cfg.shm_dir}: nothing to free")
    else:
        print(f"drop-tier: freed {size(freed)} of {cfg.shm_dir}: the host tier of {runtime_dir} "
              f"({', '.join(p.name for p in removed)})")
    return 0
