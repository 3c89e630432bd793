"""The disk tier's directory scan at start-up (kvd.tiers.disk.tier runs it on IO threads).

``ns_dirs(root)`` lists the namespace directories ``<root>/<xx>/<ns>``;
``names(dir)`` the entries of one; ``count_entries(dirs)`` how many entries
they hold together (the recovery's total, counted before the scan); ``scan_files(dir, names, own_temp_prefix)``
checks a batch of them: temp files of other processes are removed, files
whose header, version, length or name do not verify are removed (logged),
names that are not chunk files are left alone, and the valid ones come back
as ``(header, mtime, path)``. ``unlink`` ignores files already gone.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvd.tiers.disk.chunk_file import TMP_MARK, ChunkCorrupt, parse_name, read_header

log = logging.getLogger("kvd")


def unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def ns_dirs(root: Path) -> list:
    out = []
    for top in sorted(os.scandir(root), key=lambda d: d.name):
        if top.is_dir(follow_symlinks=False) and len(top.name) == 2:
            out += [Path(d.path) for d in os.scandir(top.path) if d.is_dir(follow_symlinks=False)]
    return out


def count_entries(dirs: list) -> int:
    total = 0
    for d in dirs:
        try:
            with os.scandir(d) as it:
                total += sum(1 for _ in it)
        except FileNotFoundError:
            pass  # removed since it was listed
    return total


def names(path: Path) -> list:
    return [item.name for item in os.scandir(path)]


def scan_files(path: Path, names: list, own_temp_prefix: str):
    """(found [(header, mtime, path)], bad files removed, temp files removed) of ``names``."""
    found, removed, temps = [], 0, 0
    for name in names:
        p = path / name
        if TMP_MARK in name:
            if own_temp_prefix not in name:
                unlink(p)
                temps += 1
            continue
        if parse_name(p) is None:
            continue  # not ours: leave it alone
        try:
            head = read_header(p)
            found.append((head, p.stat().st_mtime, p))
        except ChunkCorrupt as exc:
            log.warning("disk recovery: removing %s (%s)", p, exc)
            unlink(p)
            removed += 1
        except FileNotFoundError:
            pass
    return found, removed, temps
