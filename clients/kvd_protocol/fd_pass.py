"""Lending file descriptors to the daemon: the ``fds.sock`` side channel (SCM_RIGHTS).

ZeroMQ cannot carry descriptors, so one ``SOCK_SEQPACKET`` connection lends one batch:
``HEADER`` (``b"KVDF"`` + count, 1..``limits.MAX_FDS``), then ``b"F"`` messages of up to
``BATCH`` descriptors each, then the daemon's ``b"OK"`` + 16-byte token or ``b"ER"`` + reason.
The daemon admits the sender by SO_PEERCRED, keeps the descriptors ``TOKEN_TTL_S``, and
hands them only to a ``register`` of the same uid and pid (kvd.server.fd_intake). ``lend``
never closes the caller's descriptors.
"""

from __future__ import annotations

import array
import socket
import struct
from pathlib import Path

from .errors import BadRequest, DaemonUnavailable
from .limits import MAX_FDS

HEADER = struct.Struct("<4sI")
MAGIC = b"KVDF"
BATCH = 250
TOKEN_BYTES = 16
TOKEN_TTL_S = 60.0


def lend(path: Path, fds: list[int], timeout: float = 5.0) -> bytes:
    """Send ``fds`` to the daemon listening at ``path``; the token naming them."""
    if not 1 <= len(fds) <= MAX_FDS:
        raise BadRequest(f"a registration lends 1 to {MAX_FDS} file descriptors, not {len(fds)}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise DaemonUnavailable(f"cannot reach {path} to pass the KV pool's file "
                                    f"descriptors: {exc}") from None
        try:
            sock.sendall(HEADER.pack(MAGIC, len(fds)))
            for start in range(0, len(fds), BATCH):
                batch = array.array("i", fds[start:start + BATCH])
                sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, batch)])
        except OSError:
            pass  # the daemon may refuse at the header and close: its reply says why
        reply = sock.recv(256)
    except OSError as exc:
        raise DaemonUnavailable(f"passing file descriptors through {path} failed: {exc}") from None
    finally:
        sock.close()
    if not reply:
        raise DaemonUnavailable(f"the daemon closed {path} without an answer")
    if reply[:2] == b"OK" and len(reply) == 2 + TOKEN_BYTES:
        return reply[2:]
    reason = reply[2:].decode("utf-8", "replace") if reply[:2] == b"ER" else "no answer"
    raise BadRequest(f"the daemon refused the file descriptors: {reason}")
