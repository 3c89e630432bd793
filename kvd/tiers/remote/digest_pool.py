"""Payload digests of host-arena memory, computed by helper processes outside the daemon's GIL.

Why: the digest holds the GIL per 64 KiB segment, so the remote tier's checks would run
one at a time. ``DigestPool(path, size, processes)`` starts workers
(kvd.tiers.remote.digest_worker) mapping the arena read-only; ``digest(offset, view)`` equals
``payload_digest(view)``, computed by an idle worker while the caller waits off the GIL.
A worker that fails, dies, or answers late or wrongly is killed and dropped (``lost``,
logged once), and the digest computed in the caller: the answer never changes, only its
speed. ``close`` ends them; ``stats`` counts digests by where they ran.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import subprocess
import sys
import threading

from kvd.tiers.disk.digest import payload_digest
from kvd.tiers.remote.digest_worker import ANSWER_BYTES, OK, REQUEST, read_exactly

log = logging.getLogger("kvd")
TIMEOUT_S = 5.0
CORES_PER_PROCESS = 4
MAX_PROCESSES = 8


def auto_processes(asked: int, cores: int | None = None) -> int:
    """Workers for the ``remote_digest_processes`` knob: ``asked``, or with -1 one per
    ``CORES_PER_PROCESS`` cores (none on a machine of fewer), at most ``MAX_PROCESSES``."""
    if asked >= 0:
        return asked
    return min(MAX_PROCESSES, (cores or os.cpu_count() or 1) // CORES_PER_PROCESS)


class DigestPool:
    def __init__(self, path, size: int, processes: int = 0, timeout_s: float = TIMEOUT_S):
        self.path, self.size, self.timeout_s = str(path), size, timeout_s
        self.idle: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.alive: set = set()
        self.counts = {"remote": 0, "local": 0, "lost": 0}
        for _ in range(processes):
            self._start()
        self.started = len(self.alive)

    def _start(self) -> None:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvd.tiers.remote.digest_worker", self.path, str(self.size)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        except OSError as exc:
            log.warning("checksum process not started (checksums stay on the daemon's threads): "
                        "%s", exc)
            return
        self.alive.add(proc)
        self.idle.put(proc)

    def digest(self, offset: int, view) -> bytes:
        """The payload digest of ``view``, the arena's bytes at ``offset``."""
        nbytes = memoryview(view).nbytes
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes {offset}..{offset + nbytes} are outside the "
                             f"{self.size}-byte arena")
        proc = self._take() if nbytes else None
        if proc is not None:
            got = self._ask(proc, offset, nbytes)
            if got is not None:
                self.idle.put(proc)
                self._count("remote")
                return got
        self._count("local")
        return payload_digest(view)

    def _take(self):
        while True:
            with self.lock:
                if not self.alive:
                    return None
            try:
                return self.idle.get(timeout=0.1)  # every worker busy: one is back soon
            except queue.Empty:
                continue

    def _ask(self, proc, offset: int, nbytes: int) -> bytes | None:
        try:
            proc.stdin.write(REQUEST.pack(offset, nbytes))
            ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
            reply = read_exactly(proc.stdout.fileno(), ANSWER_BYTES) if ready else b""
        except (OSError, ValueError) as exc:
            reply, why = b"", f"{type(exc).__name__}: {exc}"
        else:
            why = "no answer" if not ready else "a short or refused answer"
        if len(reply) == ANSWER_BYTES and reply[0] == OK:
            return reply[1:]
        self._drop(proc, why)
        return None

    def _drop(self, proc, why: str) -> None:
        with self.lock:
            self.alive.discard(proc)
            left = len(self.alive)
        self._count("lost")
        proc.kill()
        proc.wait()
        log.warning("checksum process %d dropped (%s): %d left%s", proc.pid, why, left,
                    "" if left else "; checksums run on the daemon's threads")

    def _count(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1

    def close(self) -> None:
        with self.lock:
            procs, self.alive = list(self.alive), set()
        for proc in procs:
            proc.stdin.close()  # its end of input: it exits
        for proc in procs:
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()

    def stats(self) -> dict:
        with self.lock:
            return {"digest_processes": len(self.alive), "digests_in_processes": self.counts["remote"],
                    "digests_in_threads": self.counts["local"],
                    "digest_processes_lost": self.counts["lost"]}
