"""``kvd serve``'s start-up: checks, the tiers, the backends, the sockets, READY=1.

Cheapest check first (kvd.server.startup: one line and exit 2 for a bad value), then lock
the runtime dir, open the tiers, bind ``fds.sock`` (with the CUDA backend), ``kvd.sock`` and
``control.sock`` under umask 077 and tell systemd READY=1. Connections are admitted by
kernel peer credentials and capped per socket, uid and process (kvd.server.connections)
before any message is read. SIGTERM/SIGINT during start-up abandon it at once, remove what
was made and exit 0 with one line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import zmq
import zmq.asyncio

from kvd.copy.host import HostCopyEngine
from kvd.server import connections, metrics, startup
from kvd.server.backlog import Backlog
from kvd.server.load_verify import LoadVerifier
from kvd.server.peers import AccessPolicy, ZapGate, credentials_available, resolve_group
from kvd.server.peers_alive import Intake
from kvd.server.runtime_dir import reclaim_stale, share_socket
from kvd.server.service import Service
from kvd.tiers.disk.tiering import Tiering
from kvd_protocol import wire
from kvd_protocol.runtime import control_endpoint, engine_endpoint, instance_tag

log = logging.getLogger("kvd")
REPLY_QUEUE = 65536  # a client pipelining hard gets its busy replies; one that never reads, not all
CONTROL_REPLY_QUEUE = 64  # replies queued per operator peer (stats replies are KBs each)
CONTROL_INFLIGHT = 4  # control requests of one peer being served; more get busy at once


class DaemonStart:
    """Start-up of ``Daemon`` (kvd/server/daemon.py), whose ``__init__`` sets the state used here."""

    async def start(self) -> bool:
        t0 = time.monotonic()
        if self.stopping.is_set():
            log.info("start-up interrupted by %s: stopped", self.stop_signal)
            return False
        self.group = resolve_group(self.cfg.access_group)
        startup.check(self.cfg, self.runtime_dir, self.group)  # everything cheap, first
        self.lock.acquire()
        shm_dir = Path(self.cfg.shm_dir)
        for path in reclaim_stale(self.runtime_dir, shm_dir, instance_tag(self.runtime_dir)):
            log.info("reclaimed stale %s", path)
        if self.cfg.disk_dir:
            self.disk = startup.open_disk(self.cfg)
        if not await self.host.open():
            return False
        arena = self.host.arena
        arena_id = (arena.stat.st_dev, arena.stat.st_ino)
        engines = {"shm": HostCopyEngine(arena.view, shm_dir, self.cfg.copy_threads, arena_id)}
        log.info("host copies on %d threads", engines["shm"].threads)
        cuda = startup.make_cuda_engine(self.cfg, arena.view)
        if cuda is not None:
            engines["cuda_ipc"] = cuda
        self.service = Service(self.cfg, self.host.tier, engines, arena_id, os.urandom(8).hex())
        if self.host.journal is not None:  # checksums wait while copies are queued
            self.host.journal.hasher.idle = self.service.transfers.gate.idle
        if self.cfg.verify_loads == "on":  # warm_restart is on (config_checks): sums exist
            self.service.transfers.verifier = LoadVerifier(
                self.host.tier, self.host.journal.index, arena.view, self.cfg.verify_threads,
                self.service.stats)
        if self.disk is not None:
            self.service.tiering = Tiering(self.service.tier, self.disk, arena.view,
                                           self.cfg.disk_high_watermark, self.cfg.disk_min_hits)
            self.disk.on_progress = self._disk_progress
        if self.cfg.remote_backend != "off":
            self.service.remote = startup.make_remote(self.cfg, self.service.tier, arena.view,
                                                      arena.path)
            if self.service.tiering is not None:
                self.service.tiering.on_demote = self.service.remote.demoting
        if self.cfg.disk_gds:
            self.service.gds = startup.make_gds(self.cfg, self.service.tiering, cuda)
        if self.stopping.is_set():
            log.info("start-up interrupted by %s before serving: stopped", self.stop_signal)
            return False
        self.metrics = metrics.start(self.cfg, self.service, self.runtime_dir, self.group,
                                     AccessPolicy(self.group))
        self.ctx = zmq.asyncio.Context()
        self.gate = self._start_gate()
        limits = connections.caps(self.cfg, startup.fd_limit(), startup.fds_open())
        log.info("connections: at most %d to kvd.sock (%d per uid, %d per process; %d open "
                 "in all), %d to control.sock", *limits[0], limits[1].total)
        old = os.umask(0o077)
        try:  # fds.sock first: an engine that reconnects at once lends its descriptors there
            startup.open_fd_intake(self.service, cuda, self.runtime_dir, self.group)
            self.engine_sock = self._bind(engine_endpoint(self.runtime_dir), self.cfg.max_message_bytes,
                                          REPLY_QUEUE, limits[0], "engine")
            self.intake = Intake(self.engine_sock, self.cfg.max_inflight, lambda: self.service.stats)
            self.control_sock = self._bind(control_endpoint(self.runtime_dir), wire.MAX_HEADER_BYTES,
                                           CONTROL_REPLY_QUEUE, limits[1], "control")
            self.control_intake = Intake(self.control_sock, CONTROL_INFLIGHT,
                                         lambda: self.service.stats, "per control peer",
                                         Backlog(self.control_sock, self.service.stats))
        finally:
            os.umask(old)
        log.info("serving %s (backends %s, chunk %d tokens) — ready in %.2f s, pid %d",
                 self.runtime_dir, self.service.backends, self.cfg.chunk_tokens, time.monotonic() - t0, os.getpid())
        self.notifier.ready(self._serving())
        return True

    def _serving(self, extra: str = "") -> str:
        return (f"serving {self.runtime_dir} (backends {self.service.backends})"
                + (f"; {extra}" if extra else ""))

    def _disk_progress(self, text: str) -> None:
        self.notifier.status(self._serving(text) if self.sockets else text)

    async def _watchdog(self) -> None:
        """WATCHDOG=1 from the event loop at half systemd's interval: a wedged loop stops them."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_s / 2)

    def _bind(self, endpoint: str, max_bytes: int, reply_queue: int, limits, name: str):
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its routing id
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer fails: see peers_alive
        sock.setsockopt(zmq.SNDHWM, reply_queue)  # replies queued per client before it must read
        self.caps.append(connections.ConnectionCap(  # its monitor sees every connection
            sock, name, limits, self.service.stats, self.service.peer_log,
            self.liveness.connection_closed if name == "engine" else None))
        if self.gate is not None:
            self.gate.guard(sock, self.caps[-1])
        sock.bind(endpoint)
        share_socket(Path(endpoint.removeprefix("ipc://")), self.group)
        self.sockets.append(sock)
        return sock

    def _start_gate(self):
        """The peer-credential check of every connection (kvd.server.peers), or None where
        libzmq does not report ipc peer credentials (then the file modes alone guard)."""
        policy = AccessPolicy(self.group)
        if credentials_available():
            log.info("connections admitted: %s", policy.describe())
            return ZapGate(self.ctx, policy, self.service.stats, self.service.peer_log)
        if self.group is not None:
            raise RuntimeError("access_group needs the peer credentials of ipc connections, which "
                               "this libzmq build does not report")
        log.warning("this libzmq does not report ipc peer credentials: connections are guarded by "
                    "the runtime directory's permissions only")
        return None
