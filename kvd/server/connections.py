"""Connections to the daemon's ZeroMQ sockets, counted and capped by kernel credentials.

Why: libzmq's listener aborts the process when ``accept`` finds no descriptor, so
descriptors must never run out. ``caps(...)`` derives from the open files limit how many
connections each socket admits per uid and per process (``hard``: the most it may hold).
``ConnectionCap(sock, name, limits, stats, peer_log, on_close)`` owns the socket's monitor
and counts each accepted connection by its SO_PEERCRED. ``admit(cred)`` (asked in the ZAP
handshake) refuses a connection past a cap, which a ZeroMQ peer takes as final; one accepted
past ``hard`` or twice a cap is shut down at once. Refusals count as
``connections_over_cap`` (one line per uid per 10 s); established connections are never
touched. ``EVENT_DISCONNECTED`` uncounts a connection and calls ``on_close``.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from typing import NamedTuple

import zmq

from kvd.server.peers import PeerCred

log = logging.getLogger("kvd")
EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
RECHECK_EVERY_S = 1.0
CONTROL_MAX = 64  # operator connections at once (kvd stats, kvd top, probes)
CONTROL_PER_PROCESS = 16
KEPT_FOR_KVD = 128  # descriptors for the log, the arena, shared-memory pools being opened, ...
HANDSHAKE_S = 10  # a connection that has not finished its ZeroMQ handshake by then is closed


class Limits(NamedTuple):
    total: int  # refused in the handshake past these
    per_uid: int
    per_process: int
    hard: int  # shut down at accept past this many open (handshaken or not)


def caps(cfg, nofile: int, in_use: int) -> tuple[Limits, Limits]:
    """(engine socket, control socket) limits under an open files limit of ``nofile`` with
    ``in_use`` descriptors open now: of what is left after kvd's own descriptors, half may
    be connections (the control socket's share first), the other half is the room that keeps
    accept from failing. One uid may hold half of the engine socket's, one process a
    quarter, so that neither can lock the others out."""
    metrics = cfg.metrics_max_connections * (bool(cfg.metrics_port) + bool(cfg.metrics_socket))
    own = in_use + KEPT_FOR_KVD + 2 * cfg.disk_io_threads + metrics
    room = max(8, (nofile - own) // 2)
    control = min(CONTROL_MAX, max(2, room // 8))
    total = max(2, room - control)
    return (Limits(total, max(1, total // 2), max(1, total // 4), total + room // 2),
            Limits(control, control, min(CONTROL_PER_PROCESS, control), control + room // 8))


def peer_cred(fd: int) -> tuple[PeerCred | None, int]:
    """The kernel's credentials of the connection on descriptor ``fd`` and its inode
    (None, 0 when it is no longer a socket). The descriptor stays libzmq's: never closed."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None, 0
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return PeerCred(uid, gid, pid), os.fstat(fd).st_ino
    except OSError:
        return None, 0
    finally:
        sock.detach()


def shut_down(fd: int) -> None:
    """End the connection on ``fd``; libzmq sees it end and closes the descriptor."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


class ConnectionCap:
    def __init__(self, sock, name: str, limits: Limits, stats, peer_log, on_close=None):
        self.name, self.limits, self.stats, self.peer_log = name, limits, stats, peer_log
        self.on_close = on_close
        self.gauge = f"connections_{name}"  # open connections, in the stats' counters
        self.fds: dict[int, tuple] = {}  # open descriptor -> ((uid, pid), inode)
        self.open_by: dict[tuple, int] = {}  # (uid, pid) -> connections open
        self.open_uids: dict[int, int] = {}
        # (uid, pid) -> of those, admitted in their handshake: never more than are open, so a
        # close of that process's uncounts an admitted one once its others are all admitted
        self.admitted: dict[tuple, int] = {}
        self.admitted_uids: dict[int, int] = {}
        self.admitted_all = 0
        self.checked = -RECHECK_EVERY_S
        self.sock = sock
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_S * 1000)
        address = f"inproc://kvd-monitor-{name}-{id(sock)}"
        sock.monitor(address, EVENTS)  # before bind: no connection goes unseen
        self.monitor = sock.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(address)

    async def serve(self) -> None:
        try:
            while True:
                self._event(await self.monitor.recv_multipart())
                self.drain()  # closing fast bounds what a flood holds meanwhile
        finally:
            self.close()

    def drain(self) -> None:
        """Every event already queued, now."""
        while self.monitor is not None:
            more = self.monitor.recv_multipart(flags=zmq.NOBLOCK)  # done at once
            if not more.done() or more.exception() is not None:
                more.cancel()
                return
            self._event(more.result())

    def _event(self, frames: list) -> None:
        event, value = struct.unpack("=HI", frames[0][:6])
        if event == zmq.EVENT_ACCEPTED:
            self.accepted(value)
        elif event == zmq.EVENT_DISCONNECTED:
            self.closed(value)

    def close(self) -> None:
        if self.monitor is None:
            return
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.monitor = None

    def admit(self, cred) -> bool:
        """Whether the connection being handshaken, of ``cred``, fits the caps (counted
        as admitted then). Connections not handshaken yet count against nobody's caps: a
        burst of another process's cannot crowd out an engine's."""
        self.drain()  # its EVENT_ACCEPTED came before the handshake: it is open now
        lim, key = self.limits, (cred.uid, cred.pid)
        if (self.admitted_all < lim.total and self.admitted_uids.get(cred.uid, 0) < lim.per_uid
                and (cred.pid <= 0 or self.admitted.get(key, 0) < lim.per_process)):
            self._count(key, 1)
            return True
        self._refused(cred)
        return False

    def _count(self, key: tuple, n: int) -> None:
        self.admitted[key] = self.admitted.get(key, 0) + n
        self.admitted_uids[key[0]] = self.admitted_uids.get(key[0], 0) + n
        self.admitted_all += n
        if not self.admitted[key]:
            del self.admitted[key]
        if not self.admitted_uids[key[0]]:
            del self.admitted_uids[key[0]]

    def accepted(self, fd: int) -> None:
        self._forget(fd)  # a number libzmq closed without an event, reused
        cred, inode = peer_cred(fd)
        key = (-1, 0) if cred is None else (cred.uid, cred.pid)
        if self._too_many(key):
            self._recheck()  # first forget what libzmq closed without telling
            if self._too_many(key):
                shut_down(fd)
                self._refused(cred)
                return
        self.fds[fd] = (key, inode)
        self.open_by[key] = self.open_by.get(key, 0) + 1
        self.open_uids[key[0]] = self.open_uids.get(key[0], 0) + 1
        self.stats.counters[self.gauge] = len(self.fds)

    def _too_many(self, key: tuple) -> bool:
        """Whether the socket, or this connection's process or uid, holds so many
        connections, handshaken or not, that this one is closed at accept."""
        lim = self.limits
        return (len(self.fds) >= lim.hard or self.open_uids.get(key[0], 0) >= 2 * lim.per_uid
                or (key[1] > 0 and self.open_by.get(key, 0) >= 2 * lim.per_process))

    def closed(self, fd: int) -> None:
        if self._forget(fd) and self.on_close is not None:
            self.on_close()

    def _refused(self, cred) -> None:
        self.stats.add("connections_over_cap")
        self.stats.add(f"connections_over_cap_{self.name}")
        key = (-1, 0) if cred is None else (cred.uid, cred.pid)
        self.peer_log.log(log, logging.WARNING, ("over cap", key[0]),
                          "refused a connection to the %s socket from %s: %d connections open, "
                          "%d admitted (%d of this uid, %d of this process; caps %d, %d per uid, "
                          "%d per process, %d open in all)", self.name,
                          "a peer without credentials" if cred is None else
                          f"uid {cred.uid} pid {cred.pid}", len(self.fds), self.admitted_all,
                          self.admitted_uids.get(key[0], 0), self.admitted.get(key, 0),
                          *self.limits, burst=1)

    def _forget(self, fd: int) -> bool:
        entry = self.fds.pop(fd, None)
        if entry is None:
            return False
        key = entry[0]
        self.stats.counters[self.gauge] = len(self.fds)
        _decrement(self.open_by, key)
        _decrement(self.open_uids, key[0])
        if self.admitted.get(key, 0) > self.open_by.get(key, 0):
            self._count(key, -1)
        return True

    def _recheck(self) -> None:
        """Forget the descriptors that are no longer the connection counted (closed by
        libzmq without an event); at most once per ``RECHECK_EVERY_S``."""
        now = time.monotonic()
        if now - self.checked < RECHECK_EVERY_S:
            return
        self.checked = now
        for fd, (_, inode) in list(self.fds.items()):
            try:
                same = os.fstat(fd).st_ino == inode
            except OSError:
                same = False
            if not same:
                self._forget(fd)


def _decrement(counts: dict, key) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
