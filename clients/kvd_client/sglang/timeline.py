"""Timeline: per-call timings of kvd's SGLang backend and linker, to see where a hit's time goes.

Off unless ``$KVD_SGLANG_TRACE`` names a file; then every call appends one JSON line
(``src``, ``op``, ``t0``/``t1`` in ``time.monotonic()`` seconds, thread, pid, the op's
counts). ``examples/sglang_ttft.py --trace`` reads it back. Never raises into SGLang: a file
that cannot be written turns the timeline off with one warning.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

log = logging.getLogger("kvd_client.sglang")
ENV = "KVD_SGLANG_TRACE"


class Timeline:
    def __init__(self, src: str, path: str | None):
        self.src, self._file, self._lock = src, None, threading.Lock()
        if not path:
            return
        try:
            self._file = open(path, "a", buffering=1)
        except OSError as exc:
            log.warning("kvd: %s=%s cannot be opened (%s); no timeline", ENV, path, exc)

    @classmethod
    def from_env(cls, src: str) -> "Timeline":
        return cls(src, os.environ.get(ENV))

    @property
    def on(self) -> bool:
        return self._file is not None

    def record(self, op: str, t0: float, **fields) -> None:
        """One line for ``op``, which started at ``t0`` (monotonic) and ends now."""
        if self._file is None:
            return
        line = {"src": self.src, "op": op, "t0": t0, "t1": time.monotonic(),
                "thread": threading.current_thread().name, "pid": os.getpid(), **fields}
        with self._lock:
            try:
                self._file.write(json.dumps(line) + "\n")
            except (OSError, ValueError) as exc:
                log.warning("kvd: writing the timeline failed (%s); no timeline", exc)
                self._file = None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
