"""Lending file descriptors to the daemon: the ``fds.sock`` side channel (SCM_RIGHTS).

The engine socket is ZeroMQ, which cannot carry file descriptors, so the
descriptors of a virtual-memory KV pool (kvd_protocol.cuda_vmm) travel over a
plain Unix ``SOCK_SEQPACKET`` socket in the runtime directory, ``fds.sock``,
then the ``register`` request names them by the one-time token this exchange
returned. One connection lends one batch:

1. the client sends ``HEADER`` (``b"KVDF"``, the descriptor count as a
   little-endian uint32; 1 to ``limits.MAX_FDS``), no descriptors;
2. then messages of one byte ``b"F"``, each carrying up to ``BATCH``
   descriptors as SCM_RIGHTS, until the count is reached (the kernel carries
   at most 253 in one message);
3. the daemon answers ``b"OK"`` + a 16-byte token, or ``b"ER"`` + a UTF-8 reason.

The daemon reads the sender's uid, gid and pid from the kernel (SO_PEERCRED),
admits it as it admits engine connections (access_group), keeps the
descriptors for ``TOKEN_TTL_S`` under the token, and hands them only to a
``register`` whose session has the same uid and pid (kvd.server.fd_intake).
``lend`` never closes the caller's descriptors: the caller closes its copies
once this returns, whatever it returns.
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
