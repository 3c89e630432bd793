"""A real ``kvd serve`` in a subprocess (``DaemonProc``), for the fixtures of conftest.py
and for tests that start daemons themselves (a helper module: ``from conftest import`` is
ambiguous once a test folder has a conftest of its own)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from shm_files import arena_files

from kvd_client.transport import Channel
from kvd_protocol.runtime import control_endpoint

SESSION_TAGS: set[str] = set()  # instance tags of the runtime dirs this session's daemons used

# disk_capacity: kvd serve refuses one larger than the disk's free space (the default is 64 GiB)
DEFAULT_KNOBS = {"chunk_tokens": 16, "host_capacity": "64MiB", "heartbeat_interval_s": 0.2,
                 "client_timeout_s": 2.0, "log_level": "info", "disk_capacity": "1GiB"}


FAULT_DAEMON = Path(__file__).resolve().parent / "fault_daemon.py"


def default_sigint() -> None:
    """``preexec_fn`` of a child a test stops with SIGINT, as Ctrl-C would: a suite run in the
    background (``make test &``, nohup) ignores SIGINT, an ignored signal stays ignored across
    exec, and Python then installs no KeyboardInterrupt handler: the child would never stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class DaemonProc:
    def __init__(self, runtime_dir: Path, knobs: dict, wrapper: list | None = None,
                 env: dict | None = None, faults: str = ""):
        self.runtime_dir = runtime_dir
        self.knobs = {**DEFAULT_KNOBS, **knobs}
        self.wrapper = wrapper or []  # a command the daemon runs under (it must exec it)
        self.env = {**os.environ, **env} if env else None  # added to the environment
        self.faults = faults  # disk faults to inject (tests/disk_faults.py), comma-separated
        self.proc = None
        self.log_path = runtime_dir.parent / f"{runtime_dir.name}.log"

    def start(self, wait: bool = True) -> "DaemonProc":
        entry = [str(FAULT_DAEMON), "--faults", self.faults] if self.faults else ["-m", "kvd"]
        cmd = [*self.wrapper, sys.executable, *entry, "serve", "--runtime-dir",
               str(self.runtime_dir)]
        for key, value in self.knobs.items():  # a value of None: a flag of its own (--cold)
            cmd += [f"--{key.replace('_', '-')}"] + ([] if value is None else [str(value)])
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.control("health", timeout=0.5)
                return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"kvd did not become healthy:\n{self.log()}")

    def control(self, op: str, timeout: float = 5.0):
        ch = Channel(control_endpoint(self.runtime_dir), timeout)
        try:
            return ch.request(op)
        finally:
            ch.close()

    def stats(self) -> dict:
        return self.control("stats")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def remove_host_tier(self) -> None:
        """Delete the host tier the daemon keeps for its next start (``warm_restart``)."""
        for path in arena_files(self.runtime_dir):
            path.unlink(missing_ok=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of /proc/<pid>/status (VmRSS, RssAnon, ...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    """``predicate()``'s first true value, polled every ``interval``; an AssertionError
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
    return value


def wait_reaped(d, timeout: float = 30.0) -> dict:
    """``d.stats()`` once a dead client was reaped and no pool is registered; an
    AssertionError with the daemon's log after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (stats := d.stats())["clients_reaped"] < 1 or stats["registrations"]:
        assert time.monotonic() < deadline, f"the dead engine was not reaped:\n{d.log()}"
        time.sleep(0.05)
    return stats


@contextmanager
def engine_killed_after(target, *args, timeout: float = 60.0):
    """A spawned engine ``target(*args, conn)`` that sends one report once it is set up:
    yields that report and SIGKILLs the engine as the block ends (the block waits for the
    moment the test kills it at)."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe(duplex=False)
    engine = ctx.Process(target=target, args=(*args, child))
    engine.start()
    try:
        assert conn.poll(timeout), "the engine did not start"
        yield conn.recv()
    finally:
        os.kill(engine.pid, signal.SIGKILL)
        engine.join(10)
