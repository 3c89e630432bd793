"""A checksum process: payload digests of ranges of one shared-memory file.

``python -m kvd.tiers.remote.digest_worker PATH SIZE`` maps SIZE bytes of PATH read-only; per
request on stdin (two little-endian uint64: offset, length) it answers a status byte
(``OK``/``OUTSIDE``) and the 16-byte digest (kvd.tiers.disk.digest), in order. It ends when
stdin ends and ignores SIGINT/SIGTERM: the daemon decides when its helpers end.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import sys

from kvd.tiers.disk.digest import payload_digest

REQUEST = struct.Struct("<QQ")
OK, OUTSIDE = 0, 1
ANSWER_BYTES = 1 + 16


def read_exactly(fd: int, n: int) -> bytes:
    """``n`` bytes from ``fd``, or fewer when it ended."""
    out = b""
    while len(out) < n:
        got = os.read(fd, n - len(out))
        if not got:
            break
        out += got
    return out


def answer(mem: memoryview, request: bytes) -> bytes:
    offset, length = REQUEST.unpack(request)
    if length == 0 or offset + length > mem.nbytes:
        return bytes([OUTSIDE]) + bytes(16)
    return bytes([OK]) + payload_digest(mem[offset:offset + length])


def serve(path: str, size: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        mem = memoryview(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ))
    finally:
        os.close(fd)
    while True:
        request = read_exactly(0, REQUEST.size)
        if len(request) < REQUEST.size:
            return
        reply = answer(mem, request)
        while reply:
            reply = reply[os.write(1, reply):]


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m kvd.tiers.remote.digest_worker PATH SIZE", file=sys.stderr)
        return 2
    serve(argv[0], int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
