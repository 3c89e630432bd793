"""systemd's notify protocol (sd_notify), spoken directly over ``NOTIFY_SOCKET``.

With ``Type=notify`` systemd passes ``NOTIFY_SOCKET`` (a path, or ``@name``
for an abstract socket) and, with ``WatchdogSec=``, ``WATCHDOG_USEC``.
``Notifier.from_env()`` returns a notifier that sends newline-separated
``KEY=value`` datagrams there (``READY=1``, ``STATUS=...``,
``EXTEND_TIMEOUT_USEC=...``, ``WATCHDOG=1``, ``STOPPING=1``), or one that
sends nothing when the variable is unset. Sending never blocks and never
raises: a full or vanished socket loses that one message (systemd's own
sd_notify behaves the same). ``watchdog_s`` is the interval at which
``WATCHDOG=1`` must arrive (None: no watchdog); the daemon pings at half of it.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("kvd")


class Notifier:
    def __init__(self, address: str | None = None, watchdog_s: float | None = None):
        self.address = None
        if address:
            self.address = "\0" + address[1:] if address.startswith("@") else address
        self.watchdog_s = watchdog_s
        self._sock = None
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @classmethod
    def from_env(cls, env=None) -> "Notifier":
        env = os.environ if env is None else env
        watchdog = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            watchdog = int(usec) / 1e6
        return cls(env.get("NOTIFY_SOCKET") or None, watchdog)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:
            log.debug("sd_notify to %r failed: %s", self.address, exc)

    def status(self, text: str, extend_s: float | None = None) -> None:
        """STATUS=text; ``extend_s``: also push the start-up timeout that far out."""
        fields = [f"STATUS={text}"]
        if extend_s:
            fields.append(f"EXTEND_TIMEOUT_USEC={int(extend_s * 1e6)}")
        self.send(*fields)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
