"""Real remote stores on loopback for the remote tier's tests and ``kvd bench --remote``:
Valkey/Redis and Mooncake.

``RedisServer`` runs ``valkey-server`` or ``redis-server`` (whichever is on
PATH; Debian's packages, installed by tools/install_test_stores.sh in CI)
with no persistence on a free 127.0.0.1 port; ``MooncakeMaster`` runs the
``mooncake_master`` of the ``mooncake-transfer-engine-non-cuda`` wheel with
its HTTP metadata server. Both can be killed, frozen (SIGSTOP) and started
again on the same ports, and ``missing()`` says why a test must skip.
Every process is stopped by ``stop()``; nothing is left on disk.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout} s")


class Server:
    """A server process that can be killed, frozen and started again on the same ports."""

    what = "server"

    def __init__(self):
        self.proc = None
        self.dir = Path(tempfile.mkdtemp(prefix="kvd-store-"))

    def command(self) -> list:
        raise NotImplementedError

    def ready_port(self) -> int:
        raise NotImplementedError

    def start(self) -> Server:
        with open(self.dir / "server.log", "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.dir)
        wait_port(self.ready_port(), self.proc, self.what)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen one too
            self.proc.kill()
            self.proc.wait(10)

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        try:
            return (self.dir / "server.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""


class RedisServer(Server):
    what = "redis"

    def __init__(self):
        super().__init__()
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    @staticmethod
    def binary() -> str | None:
        return shutil.which("valkey-server") or shutil.which("redis-server")

    @classmethod
    def missing(cls) -> str | None:
        if cls.binary() is None:
            return ("neither valkey-server nor redis-server is on PATH (apt-get install "
                    "redis-server; `make test` fetches it without root: tools/install_test_stores.sh)")
        try:
            import redis  # noqa: F401
        except ImportError:
            return "the redis client is not installed (pip install redis)"
        return None

    def command(self) -> list:
        return [self.binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir)]

    def ready_port(self) -> int:
        return self.port

    def client(self):
        import redis
        return redis.Redis.from_url(self.url, socket_timeout=5)


def mooncake_master_path() -> str | None:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


class MooncakeMaster(Server):
    what = "mooncake_master"

    def __init__(self):
        super().__init__()
        self.port, self.http_port, self.admin_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"

    @classmethod
    def missing(cls) -> str | None:
        path = mooncake_master_path()
        if path is None:
            return ("mooncake_master is not installed (pip install "
                    "mooncake-transfer-engine-non-cuda: Linux x86_64)")
        probe = subprocess.run([path, "--version"], check=False, capture_output=True, text=True,
                               timeout=30)
        if "error while loading shared libraries" in probe.stderr:
            return (f"mooncake_master cannot load its libraries ({probe.stderr.strip()}); "
                    "apt-get install libibverbs1 (tools/install_test_stores.sh)")
        return None

    def command(self) -> list:
        return [mooncake_master_path(), "--rpc_port", str(self.port), "--rpc_address", "127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host", "127.0.0.1",
                "--http_metadata_server_port", str(self.http_port), "--metrics_host", "127.0.0.1",
                "--metrics_port", str(self.admin_port), "--enable_metric_reporting=false"]

    def ready_port(self) -> int:
        wait_port(self.http_port, self.proc, self.what)
        return self.port


def mooncake_env() -> dict:
    """Quiet Mooncake clients (its INFO lines flood a test daemon's log)."""
    return {"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
