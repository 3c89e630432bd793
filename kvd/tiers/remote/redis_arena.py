"""Valkey/Redis values moved straight between the host arena and a connection's socket.

``put_from``/``get_into`` on one redis-py connection: the zero-copy calls of
kvd.tiers.remote.store's ``RedisStore`` (contract as kvd.tiers.remote.mooncake's). Values
are the same bytes as on the bytes path. SETs are framed here (RESP2) around arena views;
GET replies are read by ``BulkReader`` with ``recv_into`` straight into their slots (redis-py
would build Python bytes under the GIL). A reply of another length is drained and answered
with its length; missing is None; an error reply is that value's ``RemoteError``. Any IO
failure in a batch raises and the store closes the connection, so no connection goes back
with unread replies. Without a raw socket and RESP2 (``raw_socket``) the store copies once.
"""

from __future__ import annotations

import ctypes

from kvd.tiers.remote.errors import RemoteError

LINE_READ = 4096  # a reply's first line is read this much at a time (the rest into its slot)
DRAIN_READ = 1 << 20
CRLF = b"\r\n"


def arena_view(ptr: int, size: int) -> memoryview:
    """``size`` writable bytes of the host arena at address ``ptr``."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def set_commands(names: list, heads: list, ptrs: list, sizes: list, ttl_s) -> list:
    """The buffers of one SET per value (``EX ttl_s`` unless None): small framing bytes
    joined, each payload a view of the arena."""
    ex = b"" if ttl_s is None else _bulk(b"EX") + _bulk(b"%d" % ttl_s)
    parts, pending = [], b""
    for name, head, ptr, size in zip(names, heads, ptrs, sizes):
        key = name.encode()
        pending += (b"*%d\r\n" % (5 if ex else 3) + _bulk(b"SET") + _bulk(key)
                    + b"$%d\r\n" % (len(head) + size) + head)
        parts += [pending, arena_view(ptr, size)]
        pending = CRLF + ex
    return parts + [pending]


def put_from(conn, names: list, heads: list, ptrs: list, sizes: list, ttl_s) -> list:
    """SET each ``heads[i]`` then the ``sizes[i]`` arena bytes at ``ptrs[i]`` on redis-py
    connection ``conn``, pipelined: per value None (stored) or its ``RemoteError``."""
    from redis.exceptions import ResponseError
    conn.send_packed_command(set_commands(names, heads, ptrs, sizes, ttl_s))
    out = []
    for _ in names:
        try:
            conn.read_response()
            out.append(None)
        except ResponseError as exc:  # this value failed, the stream is in step
            out.append(RemoteError(str(exc)))
    return out


def get_into(conn, names: list, head_len: int, ptrs: list, size: int) -> list:
    """GET ``names`` on redis-py connection ``conn``, pipelined, each payload into the arena
    at ``ptrs[i]``: per value as ``BulkReader.reply_into``."""
    conn.send_packed_command(conn.pack_commands([("GET", n) for n in names]))
    sock = raw_socket(conn)
    if sock is None:
        return [_copy_reply(conn, head_len, arena_view(p, size)) for p in ptrs]
    reader = BulkReader(sock)
    out = [reader.reply_into(head_len, arena_view(p, size)) for p in ptrs]
    if reader.buf:
        raise RemoteError("bytes past the last GET reply: the stream is out of step")
    return out


def raw_socket(conn):
    """The socket of redis-py connection ``conn`` where its replies may be read off it
    (RESP2), else None."""
    if getattr(conn, "protocol", 2) in (3, "3"):
        return None
    return getattr(conn, "_sock", None)


def _copy_reply(conn, head_len: int, slot: memoryview):
    """``BulkReader.reply_into`` through redis-py's parser (RESP3, or no socket to read): the
    payload copied into ``slot`` once."""
    from redis.exceptions import ResponseError
    try:
        value = conn.read_response(disable_decoding=True)
    except ResponseError as exc:
        return RemoteError(str(exc))
    if value is None:
        return None
    if len(value) != head_len + slot.nbytes:
        return len(value)
    slot[:] = memoryview(value)[head_len:]
    return bytes(value[:head_len])


class BulkReader:
    """Bulk-string replies read off ``sock`` in order, each payload into memory given."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()

    def _more(self) -> None:
        got = self.sock.recv(LINE_READ)
        if not got:
            raise ConnectionError("the store closed the connection")
        self.buf += got

    def _line(self) -> bytes:
        while (end := self.buf.find(CRLF)) < 0:
            if len(self.buf) > LINE_READ:
                raise RemoteError("a reply line too long: the stream is out of step")
            self._more()
        line = bytes(self.buf[:end])
        del self.buf[:end + 2]
        return line

    def _into(self, view: memoryview) -> None:
        n = min(len(self.buf), view.nbytes)
        view[:n] = self.buf[:n]
        del self.buf[:n]
        while n < view.nbytes:
            got = self.sock.recv_into(view[n:])
            if not got:
                raise ConnectionError("the store closed the connection")
            n += got

    def _drain(self, nbytes: int) -> None:
        scratch = bytearray(min(nbytes, DRAIN_READ))
        while nbytes:
            part = min(nbytes, len(scratch))
            self._into(memoryview(scratch)[:part])
            nbytes -= part

    def reply_into(self, head_len: int, slot: memoryview):
        """The next reply, a GET's: its head (bytes) with the rest of the value in ``slot``,
        None (no value), its length (another size: ``slot`` may hold some of it), or
        the ``RemoteError`` of an error reply."""
        line = self._line()
        if line.startswith(b"-"):
            return RemoteError(line[1:].decode(errors="replace"))
        try:
            if not line.startswith(b"$"):
                raise ValueError
            length = int(line[1:])
        except ValueError:
            raise RemoteError(f"not a GET reply: {line[:40]!r}") from None
        if length < 0:
            return None
        if length != head_len + slot.nbytes:
            self._drain(length + 2)
            return length
        head = bytearray(head_len)
        self._into(memoryview(head))
        self._into(slot)
        end = bytearray(2)
        self._into(memoryview(end))
        if end != CRLF:
            raise RemoteError("a GET reply without its CRLF: the stream is out of step")
        return bytes(head)
