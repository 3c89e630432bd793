"""Test-only entry point: ``kvd`` with disk faults injected through test doubles.

``python tests/fault_daemon.py --faults enospc,slow_read serve --runtime-dir ...``
installs the doubles of tests/disk_faults.py in this process, then runs the
``kvd`` command line with the remaining arguments. The ``start_daemon``
fixture runs it instead of ``python -m kvd`` when a test asks for faults.
"""

from __future__ import annotations

import argparse
import sys

import disk_faults


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", required=True, help=f"comma-separated: {', '.join(disk_faults.FAULTS)}")
    args, rest = ap.parse_known_args()
    disk_faults.install(f for f in args.faults.split(",") if f)
    from kvd.cli import main as kvd_main
    return kvd_main(rest)


if __name__ == "__main__":
    sys.exit(main())
