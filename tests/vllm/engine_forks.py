"""One ``engine.py serve`` process for the session's vLLM CPU engines: vLLM imported once.

Importing vLLM is most of a CPU engine's start (about 10 s on CI's VM, its
run a few seconds more), so the engine tests run every engine in a child
forked from one server that imported it (tests/vllm/engine.py, ``serve``).
Each engine is still a process of its own, with its own environment
(``VLLM_ENABLE_V1_MULTIPROCESSING`` per engine), log and result file, as
``python engine.py SPEC OUT`` would run it; engine.py asserts that the
engine core runs in or out of process as asked.

``EngineForks(python, env, log)`` starts the server (in a session of its
own), ``run(spec, out, log, env, timeout)`` runs one engine and returns its
exit status; past ``timeout`` the server and everything it started are
killed (the next ``run`` starts a new one) and ``TimeoutError`` is raised.
``close()`` ends the server and anything left of its process group.
``shared(python, env)`` is the session's server (started on first use, its log
in a temporary dir); tests/vllm/conftest.py calls ``close_shared()`` at the end.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ENGINE = Path(__file__).with_name("engine.py")
START_S = 300.0  # importing vLLM, a first time on a clean venv (compiling its .pyc) included


class EngineForks:
    def __init__(self, python: str, env: dict, log: Path):
        self.python, self.env, self.log_path = python, env, log
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([self.python, str(ENGINE), "serve"], env=self.env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, start_new_session=True)
        self._reply(START_S)

    def _reply(self, timeout: float) -> dict:
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.close(wait_s=0)
                raise TimeoutError(f"no answer from the vLLM engine server in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            self._died()
        return json.loads(line)

    def _died(self) -> None:
        code = self.proc.wait()
        self.close()
        raise RuntimeError(f"the vLLM engine server exited {code}:\n"
                           f"{self.log_path.read_text()[-6000:]}")

    def run(self, spec: Path, out: Path, log: Path, env: dict, timeout: float) -> int:
        if self.proc is None:
            self._start()
        job = {"spec": str(spec), "out": str(out), "log": str(log), "env": env}
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._died()
        return self._reply(timeout)["rc"]

    def close(self, wait_s: float = 30) -> None:
        """Ends the server: stdin closed, ``wait_s`` for it to exit, then its whole process
        group killed (whatever its engines left: nothing, when they shut down as they should)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            proc.stdin.close()
            proc.wait(wait_s)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        proc.stdout.close()
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


_SHARED: list[EngineForks] = []


def shared(python: str, env: dict) -> EngineForks:
    if not _SHARED:
        _SHARED.append(EngineForks(python, env, Path(tempfile.mkdtemp(prefix="kvd-vllm-")) / "server.log"))
    return _SHARED[0]


def close_shared() -> None:
    for forks in _SHARED:
        forks.close()
        shutil.rmtree(forks.log_path.parent, ignore_errors=True)
    _SHARED.clear()
