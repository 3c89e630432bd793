"""fds.sock: file descriptors lent over a real Unix socket (SCM_RIGHTS), taken once by token.

The daemon's ``FdIntake`` and the client's ``fd_pass.lend`` run for real in
this process (its thread serves the socket), with real descriptors (memfds):
every path, including the refused ones, must leave no descriptor open that
was not handed to the caller. Descriptors are counted in /proc/self/fd.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from kvd.server.fd_intake import FdIntake, close_fds
from kvd.server.peers import AccessPolicy, PeerCred
from kvd_protocol import fd_pass, wire
from kvd_protocol.errors import BadRequest, Forbidden

ME = PeerCred(os.getuid(), os.getgid(), os.getpid())


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settles_at(count: int) -> bool:
    """Whether this process's descriptor count comes back to ``count`` (the intake's thread
    closes its end of a connection just after answering)."""
    end = time.monotonic() + 2.0
    while open_fds() != count and time.monotonic() < end:
        time.sleep(0.01)
    return open_fds() == count


@pytest.fixture
def intake(tmp_path):
    it = FdIntake(tmp_path / "fds.sock", AccessPolicy(None))
    it.open()
    yield it
    it.close()
    assert not (tmp_path / "fds.sock").exists()


def memfds(n: int) -> list[int]:
    fds = []
    for i in range(n):
        fd = os.memfd_create(f"kvd-test-{i}")
        os.ftruncate(fd, 4096 * (i + 1))
        fds.append(fd)
    return fds


def test_lent_descriptors_are_the_same_files_and_taken_once(intake):
    before = open_fds()
    mine = memfds(3)
    token = fd_pass.lend(intake.path, mine)
    taken = intake.take(token, ME)
    assert [os.fstat(a).st_ino for a in taken] == [os.fstat(b).st_ino for b in mine]
    assert [os.fstat(a).st_size for a in taken] == [4096, 8192, 12288]
    with pytest.raises(BadRequest, match="no file descriptors"):
        intake.take(token, ME)
    close_fds(mine + taken)
    assert settles_at(before)


def test_more_descriptors_than_one_message_carries(intake):
    before = open_fds()
    mine = memfds(600)  # three messages: the kernel carries at most 253 in one
    taken = intake.take(fd_pass.lend(intake.path, mine), ME)
    assert len(taken) == 600 and os.fstat(taken[-1]).st_size == 600 * 4096
    close_fds(mine + taken)
    assert settles_at(before)


def test_another_process_cannot_take_them_and_they_are_closed(intake):
    before = open_fds()
    for cred in (PeerCred(ME.uid, ME.gid, ME.pid + 1), PeerCred(ME.uid + 1, ME.gid, ME.pid), None):
        mine = memfds(2)
        token = fd_pass.lend(intake.path, mine)
        close_fds(mine)
        with pytest.raises(Forbidden):
            intake.take(token, cred)
    assert settles_at(before)


def test_expired_batches_are_closed(intake, monkeypatch):
    before = open_fds()
    monkeypatch.setattr(fd_pass, "TOKEN_TTL_S", -1.0)  # expired as soon as kept
    mine = memfds(2)
    token = fd_pass.lend(intake.path, mine)
    close_fds(mine)
    with pytest.raises(BadRequest, match="expired"):
        intake.take(token, ME)
    assert settles_at(before)


def raw_exchange(path, messages) -> bytes:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5)
    sock.connect(str(path))
    try:
        for data, fds in messages:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
            sock.sendmsg([data], anc)
        return sock.recv(256)
    finally:
        sock.close()


@pytest.mark.parametrize("case", ["bad_magic", "zero", "too_many", "fewer", "more", "one_message_too_many"])
def test_bad_lending_is_refused_and_leaves_nothing_open(intake, case):
    before = open_fds()
    mine = memfds(3)
    head = fd_pass.HEADER.pack
    messages = {
        "bad_magic": [(head(b"XXXX", 3), [])],
        "zero": [(head(fd_pass.MAGIC, 0), [])],
        "too_many": [(head(fd_pass.MAGIC, 10 ** 6), [])],
        "fewer": [(head(fd_pass.MAGIC, 3), []), (b"F", mine[:2]), (b"X", mine[2:])],
        "more": [(head(fd_pass.MAGIC, 2), []), (b"F", mine)],
        "one_message_too_many": [(head(fd_pass.MAGIC, 300), []), (b"F", memfds(0) + mine * 84)],
    }[case]
    reply = raw_exchange(intake.path, messages)
    assert reply[:2] == b"ER", reply
    assert not intake.waiting
    close_fds(mine)
    assert settles_at(before)


def test_close_closes_what_was_never_taken(tmp_path):
    before = open_fds()
    it = FdIntake(tmp_path / "fds.sock", AccessPolicy(None))
    it.open()
    mine = memfds(4)
    fd_pass.lend(it.path, mine)
    close_fds(mine)
    it.close()
    assert settles_at(before)


def test_descriptors_waiting_at_once_are_bounded(tmp_path):
    """A peer lending batch after batch without registering cannot use up the daemon's
    open-files budget: past ``max_held`` a batch is refused at its header, received
    descriptors are closed, and a taken batch makes room again."""
    before = open_fds()
    it = FdIntake(tmp_path / "fds.sock", AccessPolicy(None), max_held=5)
    it.open()
    mine = memfds(3)
    first = fd_pass.lend(it.path, mine)
    with pytest.raises(Exception, match="at most 5 at once"):
        fd_pass.lend(it.path, mine)
    assert it.held() == 3
    close_fds(it.take(first, ME))
    close_fds(it.take(fd_pass.lend(it.path, mine), ME))
    close_fds(mine)
    it.close()
    assert settles_at(before)


def test_refused_peer_gets_no_token(tmp_path):
    it = FdIntake(tmp_path / "fds.sock", AccessPolicy(None))
    it.policy.uid = -5  # as if the daemon ran as another user: this process is not allowed
    if os.getuid() == 0:
        pytest.skip("root is always allowed")
    it.open()
    try:
        before = open_fds()
        mine = memfds(1)
        with pytest.raises(BadRequest, match="not allowed"):
            fd_pass.lend(it.path, mine)
        close_fds(mine)
        assert settles_at(before) and not it.waiting
    finally:
        it.close()


def test_cuda_vmm_buffers_on_the_wire():
    good = {"kind": "cuda_vmm", "token": bytes(16), "pieces": [2 << 20, 4 << 20], "offset": 0,
            "size": 6 << 20, "device_uuid": "ab" * 16}
    assert wire.buffers_from_wire([good], 4) == [good]
    for bad in ({**good, "token": bytes(8)}, {**good, "pieces": []}, {**good, "pieces": [0]},
                {**good, "pieces": [-1]}, {**good, "pieces": "x"}, {**good, "fds": [3]},
                {k: v for k, v in good.items() if k != "token"}):
        with pytest.raises(BadRequest):
            wire.buffers_from_wire([bad], 4)
    with pytest.raises(BadRequest, match="pieces"):
        wire.buffers_from_wire([{**good, "pieces": [1] * 3000}] * 2, 4)
