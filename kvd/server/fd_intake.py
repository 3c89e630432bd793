"""The daemon's end of ``fds.sock``: file descriptors lent for a registration (SCM_RIGHTS).

Owns the listening socket, a thread taking one lending connection at a time
(kvd_protocol.fd_pass), and descriptors lent but not yet taken, by token. Connections are
admitted by SO_PEERCRED under the engines' ``AccessPolicy``; every descriptor of a failed
connection is closed. ``take(token, cred)`` hands a batch once to a ``register`` of the
same uid and pid; batches not taken within ``TOKEN_TTL_S`` are closed, as is all at
``close``. At most ``max_held`` descriptors wait at once (a batch past that is read, closed and
refused): lending cannot exhaust the open-files budget. Never touches what the
descriptors refer to (kvd.cuda maps them).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

from kvd_protocol import fd_pass
from kvd_protocol.errors import BadRequest, Forbidden
from kvd_protocol.limits import MAX_FDS

from .peers import AccessPolicy, PeerCred

log = logging.getLogger("kvd")
MAX_WAITING = 64    # batches lent and not yet taken
IO_TIMEOUT_S = 2.0  # each message of a lending connection; the whole exchange: a few of these
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass
class _Lent:
    cred: PeerCred
    fds: list
    deadline: float


class FdIntake:
    def __init__(self, path, policy: AccessPolicy, max_held: int = MAX_FDS):
        self.path, self.policy, self.max_held = path, policy, max_held
        self.waiting: dict[bytes, _Lent] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.sock = None
        self.thread = None

    def open(self) -> None:
        try:
            os.unlink(self.path)  # a dead daemon's (the instance lock is ours)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(str(self.path))
        self.sock.listen(16)
        self.sock.settimeout(0.25)  # how soon the thread sees ``stopping``
        self.thread = threading.Thread(target=self._serve, name="kvd-fds", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                if self.stopping.is_set():
                    return
                raise
            with conn:
                conn.settimeout(IO_TIMEOUT_S)
                try:
                    conn.sendall(self._answer(conn))
                except OSError as exc:
                    log.info("a file-descriptor lending connection failed: %s", exc)

    def _answer(self, conn) -> bytes:
        pid, uid, gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      _CRED.size))
        cred = PeerCred(uid, gid, pid)
        if not self.policy.allows(cred):
            log.warning("refused file descriptors from uid %d pid %d: allowed are %s", uid, pid,
                        self.policy.describe())
            return b"ER" + b"not allowed (access_group)"
        fds: list[int] = []
        try:
            why = self._receive(conn, fds)
            if why is None:
                why = self._keep(cred, fds)
            if isinstance(why, bytes):
                fds = []  # kept: no longer ours to close here
                return b"OK" + why
            return b"ER" + why.encode()
        finally:
            close_fds(fds)

    def _receive(self, conn, fds: list) -> str | None:
        """Fill ``fds`` with the batch; the reason it is refused, or None."""
        head = conn.recv(fd_pass.HEADER.size + 1)
        if len(head) != fd_pass.HEADER.size:
            return "bad header"
        magic, count = fd_pass.HEADER.unpack(head)
        if magic != fd_pass.MAGIC or not 1 <= count <= MAX_FDS:
            return f"bad header (1 to {MAX_FDS} file descriptors)"
        over = None  # past the budget: still read the batch (closing it) so the reply arrives
        if count > self.max_held - self.held():
            over = (f"{count} file descriptors lent while {self.held()} wait for their "
                    f"registration: at most {self.max_held} at once (the open-files limit)")
        room = socket.CMSG_SPACE(fd_pass.BATCH * 4)
        deadline = time.monotonic() + IO_TIMEOUT_S * (2 + count // fd_pass.BATCH)
        received = 0
        while received < count:
            if time.monotonic() > deadline:  # one lender must not hold the thread for long
                return "too slow"
            data, ancillary, flags, _ = conn.recvmsg(2, room)
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(payload) - len(payload) % 4
                    got = list(struct.unpack(f"{usable // 4}i", payload[:usable]))
                    received += len(got)
                    if over:
                        close_fds(got)
                    else:
                        fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                return f"more than {fd_pass.BATCH} file descriptors in one message"
            if data != b"F":
                return "bad message"
        if received != count:
            return f"{received} file descriptors sent, {count} announced"
        return over

    def _keep(self, cred: PeerCred, fds: list):
        now = time.monotonic()
        with self.lock:
            self._expire(now)
            if len(self.waiting) >= MAX_WAITING:
                return "too many batches waiting for their registration"
            token = os.urandom(fd_pass.TOKEN_BYTES)
            self.waiting[token] = _Lent(cred, list(fds), now + fd_pass.TOKEN_TTL_S)
        return token

    def held(self) -> int:
        """Descriptors lent and waiting for their registration."""
        with self.lock:
            self._expire(time.monotonic())
            return sum(len(lent.fds) for lent in self.waiting.values())

    def _expire(self, now: float) -> None:
        for token in [t for t, lent in self.waiting.items() if lent.deadline < now]:
            close_fds(self.waiting.pop(token).fds)

    def take(self, token: bytes, cred: PeerCred | None) -> list[int]:
        """The descriptors lent under ``token`` by the peer ``cred``; the caller closes them."""
        with self.lock:
            self._expire(time.monotonic())
            lent = self.waiting.pop(token, None)
        if lent is None:
            raise BadRequest("no file descriptors were lent under this token (or it expired: "
                             f"{fd_pass.TOKEN_TTL_S:.0f} s)")
        if cred is None or cred.uid != lent.cred.uid or (cred.pid and lent.cred.pid
                                                          and cred.pid != lent.cred.pid):
            close_fds(lent.fds)
            raise Forbidden("these file descriptors were lent by another process")
        return lent.fds

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=2.0)
        if self.sock is not None:
            self.sock.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        with self.lock:
            for lent in self.waiting.values():
                close_fds(lent.fds)
            self.waiting.clear()


def close_fds(fds) -> None:
    """Close each descriptor, ignoring those already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
