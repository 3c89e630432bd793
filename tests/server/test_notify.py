"""systemd readiness: a real ``kvd serve`` talks sd_notify to a datagram socket the test binds.

The test plays systemd: it binds an AF_UNIX datagram socket (a path, or an
abstract name given as ``@name``), passes it as ``NOTIFY_SOCKET`` (and
``WATCHDOG_USEC``) and reads what the daemon sends: STATUS lines while it
starts, READY=1 only once its control socket answers, WATCHDOG=1 from its
event loop, the disk recovery scan's status, STOPPING=1 at SIGTERM.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import time

import pytest

from kvd.tiers.disk.chunk_file import ChunkFiles


class FakeSystemd:
    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.address = address
        self.messages: list[dict] = []

    def receive(self, until, timeout: float = 30.0) -> list[dict]:
        """Messages (each a dict of its fields) until ``until(message)`` is true."""
        deadline = time.monotonic() + timeout
        got = []
        while time.monotonic() < deadline:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                raw = self.sock.recv(65536).decode()
            except TimeoutError:
                break
            msg = dict(line.split("=", 1) for line in raw.split("\n") if line)
            got.append(msg)
            self.messages.append(msg)
            if until(msg):
                return got
        raise AssertionError(f"not received; got {got}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def systemd(tmp_path):
    s = FakeSystemd(str(tmp_path / "notify.sock"))
    yield s
    s.close()


def test_status_then_ready_once_serving_then_watchdog_then_stopping(start_daemon, systemd):
    d = start_daemon(wait=False, env={"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": "200000"})
    before = systemd.receive(lambda m: m.get("READY") == "1")
    assert d.control("health", timeout=1.0)["status"] == "ok"  # READY means: sockets answer
    statuses = [m["STATUS"] for m in before if "STATUS" in m]
    assert statuses[0].startswith("allocating the host tier: 64MiB at /dev/shm/kvd-arena-")
    ready = before[-1]
    assert ready["STATUS"].startswith(f"serving {d.runtime_dir} (backends host")
    assert ready["MAINPID"] == str(d.proc.pid)
    # WATCHDOG=1 every 0.1 s (half of WATCHDOG_USEC): count for a second
    pings, deadline = 0, time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if systemd.receive(lambda m: True, timeout=1.0)[0].get("WATCHDOG") == "1":
            pings += 1
    assert pings >= 4
    d.stop(signal.SIGTERM)
    stopping = systemd.receive(lambda m: m.get("STOPPING") == "1", timeout=10)[-1]
    assert stopping["STATUS"].startswith("shutting down")


def test_abstract_socket_and_a_watchdog_meant_for_another_pid(start_daemon):
    """``@name`` is an abstract socket; WATCHDOG_PID of another process: no pings from us."""
    systemd = FakeSystemd(f"@kvd-test-{secrets.token_hex(6)}")
    try:
        start_daemon(wait=False, env={"NOTIFY_SOCKET": systemd.address, "WATCHDOG_USEC": "100000",
                                      "WATCHDOG_PID": str(os.getpid())})
        systemd.receive(lambda m: m.get("READY") == "1")
        time.sleep(0.5)
        systemd.sock.setblocking(False)
        later = []
        while True:
            try:
                later.append(systemd.sock.recv(65536))
            except BlockingIOError:
                break
        assert not any(b"WATCHDOG=1" in raw for raw in later)
        assert not any("WATCHDOG" in m for m in systemd.messages)
    finally:
        systemd.close()


def test_disk_recovery_progress_in_status_and_stats(start_daemon, systemd, tmp_path):
    disk = tmp_path / "disk"
    files = ChunkFiles(disk)
    ns = bytes(range(16))
    good = [files.write(ns, secrets.token_bytes(16), bytes(4096), 1, 4096) for _ in range(40)]
    corrupt = good[0].with_name(secrets.token_hex(16) + ".kvc")
    corrupt.write_bytes(b"not a chunk file")
    (good[0].parent / f"{good[1].name}.tmp-1-dead-beef").write_bytes(b"x")  # a dead writer's
    d = start_daemon(wait=False, disk_dir=disk, env={"NOTIFY_SOCKET": systemd.address})
    systemd.receive(lambda m: m.get("READY") == "1")
    done = systemd.receive(lambda m: "disk recovery done" in m.get("STATUS", ""), timeout=30)
    statuses = [m["STATUS"] for m in done if "STATUS" in m]
    assert any("disk recovery: scanning 42 files in 1 directories" in s for s in statuses)
    assert statuses[-1] == f"serving {d.runtime_dir} (backends host); disk recovery done: 40 chunks"
    rec = d.stats()["tiers"]["disk"]["recovery"]
    assert (rec["state"], rec["files_scanned"], rec["files_total"]) == ("done", 42, 42)
    assert (rec["chunks"], rec["removed"], rec["temp_removed"]) == (40, 1, 1)
