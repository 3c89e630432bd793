"""What the fake GPU did, as JSON lines a test reads afterwards (``FAKECUDA_TRACE``).

When the environment names a file in ``FAKECUDA_TRACE``, every process
using the fake appends one line per event: ``{"ev", "t", "pid", ...}``
with ``t`` from ``time.monotonic()`` (one clock for all processes of a
machine). Events: ``kernel`` (name, ``t0``/``t``, layers, chunks, whether
the cancel word skipped it, the names of the regions it touched),
``dma`` (pieces, the regions written, ``queued_by``: the thread that queued it),
``write32`` (region name, byte offset in it, value), ``ipc_open`` and
``ipc_close`` (the allocation's name), ``error``. Region names are
process-independent: an engine allocation is ``<pid>:<serial>`` in every
process that maps it; registered host memory is named after the file it
maps (``kvd-flags-...``), found in /proc/self/maps. Nothing is written when
the variable is unset.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

_lock = threading.Lock()


def path() -> str | None:
    return os.environ.get("FAKECUDA_TRACE") or None


def emit(ev: str, **fields) -> None:
    where = path()
    if where is None:
        return
    line = json.dumps({"ev": ev, "t": time.monotonic(), "pid": os.getpid(), **fields})
    with _lock, open(where, "a") as f:
        f.write(line + "\n")


def read(where: str | Path) -> list[dict]:
    """Every event of the file, in the order written."""
    try:
        text = Path(where).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]
