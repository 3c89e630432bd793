"""Redis's zero-copy calls (kvd/tiers/remote/redis_arena.py, ``RedisStore.put_from``/``get_into``).

``BulkReader`` reads GET replies off a real socket pair fed a byte at a time
(a reply split anywhere): heads and payloads exact, nil, error replies, a value
of another size drained so the next reply still reads right, and a stream out
of step or closed raising. Against a real Redis server: values put from arena
memory are the bytes a plain SET of head + payload stores (with the TTL); GETs
land payloads in arena slots, the slots of missing, other-size and wrong-type
values come back as such and the others of the call are exact (the default
reads replies off the socket: RESP2, also where redis-py speaks RESP3 by
default); RESP3 (replies through redis-py's parser, one copy) gives the
same answers; a call cut by a
frozen server raises and its connection is not handed out again: the next call
is exact.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading

import numpy as np
import pytest
from remote_servers import RedisServer, running

from kvd.tiers.remote.errors import RemoteError
from kvd.tiers.remote.redis_arena import BulkReader, arena_view, raw_socket
from kvd.tiers.remote.store import RedisStore

HEAD, SIZE = 24, 4096 + 7  # a payload not a multiple of any read size


@pytest.fixture
def redis_server():
    yield from running("redis")


def feed(data: bytes, step: int = 1):
    """A socket whose peer sends ``data`` ``step`` bytes at a time, then closes."""
    ours, theirs = socket.socketpair()

    def send() -> None:
        with theirs:
            for i in range(0, len(data), step):
                theirs.sendall(data[i:i + step])
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return ours, sender


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def test_bulk_replies_read_a_byte_at_a_time_land_exact():
    values = [os.urandom(HEAD + SIZE) for _ in range(2)]
    other = os.urandom(HEAD + SIZE + 5)
    stream = (bulk(values[0]) + b"$-1\r\n" + b"-WRONGTYPE not a string\r\n" + bulk(other)
              + bulk(values[1]))
    sock, sender = feed(stream, 1)
    slots = np.full((5, SIZE), 0xAB, np.uint8)
    with sock:
        reader = BulkReader(sock)
        got = [reader.reply_into(HEAD, memoryview(slots[i])) for i in range(5)]
        assert not reader.buf
    sender.join()
    assert got[0] == values[0][:HEAD] and bytes(slots[0]) == values[0][HEAD:]
    assert got[1] is None and (slots[1] == 0xAB).all()
    assert isinstance(got[2], RemoteError) and "WRONGTYPE" in str(got[2])
    assert got[3] == len(other)  # drained: the next reply reads right
    assert got[4] == values[1][:HEAD] and bytes(slots[4]) == values[1][HEAD:]


@pytest.mark.parametrize("stream", [b"+OK\r\n", b"$12x\r\n", b"$%d\r\n" % (HEAD + SIZE)
                                    + bytes(HEAD + SIZE) + b"XY", b"$%d\r\n" % (HEAD + SIZE),
                                    b"-" * 5000])
def test_a_stream_out_of_step_or_cut_raises(stream):
    sock, sender = feed(stream, 4096)
    with sock, pytest.raises((RemoteError, ConnectionError)):
        BulkReader(sock).reply_into(HEAD, memoryview(bytearray(SIZE)))
    sender.join()


def store_on(server, query: str = "") -> RedisStore:
    store = RedisStore(server.url + query, 2.0, ttl_s=100)
    store.connect()
    return store


def arena(n: int) -> tuple[np.ndarray, list]:
    mem = np.zeros(n * SIZE + 64, np.uint8)
    return mem, [mem.ctypes.data + 64 + i * SIZE for i in range(n)]


@pytest.mark.parametrize("query", ["", "?protocol=3"])
def test_put_from_and_get_into_move_exact_values(redis_server, query):
    store, plain = store_on(redis_server, query), redis_server.client()
    pool = store.client.connection_pool
    conn = pool.get_connection()
    # the default reads GET replies off the socket; RESP3 through redis-py's parser
    assert (raw_socket(conn) is None) == (query == "?protocol=3")
    pool.release(conn)
    try:
        mem, ptrs = arena(3)
        payloads = [os.urandom(SIZE) for _ in range(3)]
        for ptr, p in zip(ptrs, payloads):
            arena_view(ptr, SIZE)[:] = p
        heads = [os.urandom(HEAD) for _ in range(3)]
        names = [f"t/{query}/{i}" for i in range(3)]
        assert store.put_from(names, heads, ptrs, [SIZE] * 3) == [None] * 3
        for name, head, p in zip(names, heads, payloads):
            assert plain.get(name) == head + p and 0 < plain.ttl(name) <= 100
        plain.set("t/short", b"x" * 10)
        plain.rpush("t/list", b"a")
        mem[:] = 0xCD
        asked = [names[0], "t/missing", "t/short", "t/list", names[2]]
        out, back = arena(len(asked))
        got = store.get_into(asked, HEAD, back, SIZE)
        assert got[0] == heads[0] and bytes(arena_view(back[0], SIZE)) == payloads[0]
        assert got[1] is None and got[2] == 10 and isinstance(got[3], RemoteError)
        assert got[4] == heads[2] and bytes(arena_view(back[4], SIZE)) == payloads[2]
        with pytest.raises(RemoteError):  # every value failed: the call raises
            store.get_into(["t/list"], HEAD, back[:1], SIZE)
        assert store.put_from(["t/list"], heads[:1], ptrs[:1], [SIZE]) == [None]  # SET replaces
    finally:
        plain.flushall()
        plain.close()
        store.close()


def test_a_cut_call_drops_its_connection_and_the_next_call_is_exact(redis_server):
    store = store_on(redis_server)
    store.client.connection_pool.connection_kwargs["socket_timeout"] = 0.3
    store.client.connection_pool.reset()
    try:
        _, ptrs = arena(2)
        payloads = [os.urandom(SIZE) for _ in range(2)]
        for ptr, p in zip(ptrs, payloads):
            arena_view(ptr, SIZE)[:] = p
        heads = [b"c" * HEAD, b"n" * HEAD]
        assert store.put_from(["cut", "next"], heads, ptrs, [SIZE] * 2) == [None] * 2
        redis_server.freeze()
        try:
            with pytest.raises(Exception):
                store.get_into(["cut"], HEAD, ptrs[:1], SIZE)
        finally:
            redis_server.thaw()
        # a connection kept with the cut GET's reply unread would answer this with "cut"
        assert store.get_into(["next"], HEAD, ptrs[1:], SIZE) == [heads[1]]
        assert bytes(arena_view(ptrs[1], SIZE)) == payloads[1]
    finally:
        store.close()


class TlsRedisServer(RedisServer):
    """A Redis server that speaks only TLS, with a self-signed certificate made by openssl."""

    def command(self) -> list:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", "key.pem", "-out", "cert.pem", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], cwd=self.dir, check=True,
                       capture_output=True)
        self.url = f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.dir / 'cert.pem'}"
        return [self.binary(), "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
                "--tls-cert-file", "cert.pem", "--tls-key-file", "key.pem", "--tls-ca-cert-file",
                "cert.pem", "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir)]


def test_over_tls_values_land_exact_through_the_socket_reader():
    if RedisServer.missing() or shutil.which("openssl") is None:
        pytest.skip(RedisServer.missing() or "no openssl to make a certificate")
    server = TlsRedisServer()
    try:
        try:
            server.start()
        except RuntimeError as exc:  # a build without TLS refuses --tls-port
            pytest.skip(f"this Redis server does not speak TLS: {exc}: {server.log()[-300:]}")
        store = RedisStore(server.url, 5.0)
        store.connect()
        pool = store.client.connection_pool
        conn = pool.get_connection()
        assert "SSL" in type(raw_socket(conn)).__name__
        pool.release(conn)
        size = 4 << 20
        mem = np.zeros(2 * size, np.uint8)
        ptrs = [mem.ctypes.data, mem.ctypes.data + size]
        payload = os.urandom(size)
        arena_view(ptrs[0], size)[:] = payload
        assert store.put_from(["tls"], [b"h" * HEAD], ptrs[:1], [size]) == [None]
        assert store.get_into(["tls", "none"], HEAD, ptrs[1:] * 2, size) == [b"h" * HEAD, None]
        assert bytes(arena_view(ptrs[1], size)) == payload
        store.close()
    finally:
        server.stop()
