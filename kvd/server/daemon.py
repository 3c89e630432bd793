"""``kvd serve``: start-up, the two ROUTER sockets, reaping, and shutdown.

Start-up: resolve and lock the runtime dir, reclaim what a dead daemon
left, allocate the arena, bind ``kvd.sock`` (engines) and ``control.sock``
(operators) under umask 077, then open them to ``access_group`` if set
(kvd.server.runtime_dir); every connection is admitted or refused by its
kernel peer credentials (kvd.server.peers) before any of its messages is
read, and each request carries the credentials of its connection. Each request runs as its own task so a slow
copy never blocks other clients; every reply goes back through the socket
it came from. A request that fails validation gets a typed error reply; a
peer that sends a frame larger than ``max_message_bytes`` is dropped by
ZeroMQ (its limit is per frame), and a message whose frames together exceed
it gets a ``too_large`` reply and is not run.
With ``disk_dir`` set, the disk tier (kvd.tiers.tiering) starts with the loop and
scans its directory in the background. SIGTERM/SIGINT: stop reading, end
every request waiting on a client (``shutting_down``), let the others (and
their copies) finish within ``shutdown_grace_s`` in all, finish disk IO,
remove sockets and arena, exit 0: bounded whatever the GPU or the clients
do, since no copy waits on another process.
Reaping: a session silent for ``client_timeout_s`` with no request being
served is reaped. Sooner when its peer is gone: ZeroMQ's socket monitor
says that some connection closed (not whose), so the daemon then probes
every session's routing id with a ``{v, id: 0, result: {}}`` message
(clients drop replies to ids they never sent); with ``ROUTER_MANDATORY`` a
routing id that has no connection any more fails at once, and that session
is reaped.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import time
from pathlib import Path

import zmq
import zmq.asyncio

from kvd.copy.host import HostCopyEngine
from kvd.server import control, metrics
from kvd.server.peers import AccessPolicy, ZapGate, credentials_available, recv_request, resolve_group
from kvd.server.runtime_dir import InstanceLock, prepare_runtime_dir, reclaim_stale, share_socket
from kvd.server.service import Service
from kvd.tiers.arena import SharedArena
from kvd.tiers.host import HostTier
from kvd_protocol import wire
from kvd_protocol.errors import ServerError, ShuttingDown, TooLarge
from kvd_protocol.runtime import control_endpoint, engine_endpoint, instance_tag, resolve_runtime_dir

log = logging.getLogger("kvd")
PROBE = wire.pack({"v": wire.VERSION, "id": 0, "result": {}})
PROBE_DELAY_S = 0.25
REPLY_PATIENCE_S = 5.0


class Daemon:
    def __init__(self, cfg):
        self.cfg = cfg
        self.runtime_dir = resolve_runtime_dir(cfg.runtime_dir or None)
        self.lock = InstanceLock(self.runtime_dir)
        self.stopping = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.arena = None
        self.service = None
        self.ctx = None
        self.sockets = []
        self.probe_due: float | None = None
        self.metrics = None  # the /metrics HTTP server (kvd.server.metrics), when metrics_port is set
        self.group = resolve_group(cfg.access_group)  # gid engines of other users connect with
        self.gate = None  # kvd.server.peers.ZapGate: admits connections by their peer credentials

    def start(self) -> None:
        t0 = time.monotonic()
        prepare_runtime_dir(self.runtime_dir, self.group)
        self.lock.acquire()
        shm_dir = Path(self.cfg.shm_dir)
        for path in reclaim_stale(self.runtime_dir, shm_dir, instance_tag(self.runtime_dir)):
            log.info("reclaimed stale %s", path)
        self.arena = SharedArena(shm_dir, instance_tag(self.runtime_dir), self.cfg.host_capacity)
        log.info("host tier: %.1f MiB at %s, allocated in %.2f s", self.cfg.host_capacity / 2**20,
                 self.arena.path, self.arena.setup_seconds)
        engines = {"shm": HostCopyEngine(self.arena.view, shm_dir, self.cfg.copy_threads,
                                             self.arena.path)}
        cuda = make_cuda_engine(self.cfg, self.arena.view)
        if cuda is not None:
            engines["cuda_ipc"] = cuda
        align = 4096 if self.cfg.disk_dir else 256  # 4096: disk IO straight to/from slots
        st = os.stat(self.arena.path)
        self.service = Service(self.cfg, HostTier(self.cfg.host_capacity, align), engines,
                               (st.st_dev, st.st_ino), os.urandom(8).hex())
        if self.cfg.disk_dir:
            self.service.tiering = make_tiering(self.cfg, self.service.tier, self.arena.view)
        if self.cfg.disk_gds:
            self.service.gds = make_gds(self.cfg, self.service.tiering, cuda)
        self.metrics = metrics.start(self.cfg, self.service)
        self.ctx = zmq.asyncio.Context()
        self.gate = self._start_gate()
        old = os.umask(0o077)
        try:
            self.engine_sock = self._bind(engine_endpoint(self.runtime_dir), self.cfg.max_message_bytes)
            self.control_sock = self._bind(control_endpoint(self.runtime_dir), wire.MAX_HEADER_BYTES)
        finally:
            os.umask(old)
        log.info("serving %s (backends %s, chunk %d tokens) — ready in %.2f s, pid %d",
                 self.runtime_dir, self.service.backends, self.cfg.chunk_tokens, time.monotonic() - t0, os.getpid())

    def _bind(self, endpoint: str, max_bytes: int):
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its routing id
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer fails: see _probe_peers
        if self.gate is not None:
            ZapGate.guard(sock)
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
            return ZapGate(self.ctx, policy, self.service.stats)
        if self.group is not None:
            raise RuntimeError("access_group needs the peer credentials of ipc connections, which "
                               "this libzmq build does not report")
        log.warning("this libzmq does not report ipc peer credentials: connections are guarded by "
                    "the runtime directory's permissions only")
        return None

    async def main(self) -> None:
        self.start()
        await self.run()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        readers = [asyncio.create_task(self._serve(self.engine_sock, wire.OPS, self._engine_op)),
                   asyncio.create_task(self._serve(self.control_sock, wire.CONTROL_OPS, self._control_op)),
                   asyncio.create_task(self._reaper()),
                   asyncio.create_task(self._watch_disconnects())]
        if self.gate is not None:
            readers.append(asyncio.create_task(self.gate.serve()))
        if self.service.tiering is not None:
            self.service.tiering.start()  # recovery scan runs in the background
        await self.stopping.wait()
        deadline = time.monotonic() + self.cfg.shutdown_grace_s
        log.info("shutting down: finishing %d requests in flight (at most %.1f s)", len(self.tasks),
                 self.cfg.shutdown_grace_s)
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        self.service.stop_waiting()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=max(0.0, deadline - time.monotonic()))
        if self.service.tiering is not None:  # finish disk IO before the arena goes
            try:
                await asyncio.wait_for(self.service.tiering.stop(),
                                       max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.warning("disk writes still running after shutdown_grace_s; exiting anyway")

    def close(self) -> None:
        if self.lock.fd < 0:
            return  # never owned the runtime dir: touch nothing in it
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics.server_close()
        for sock in self.sockets:
            sock.close(linger=0)
        if self.gate is not None:
            self.gate.close()
        if self.ctx is not None:
            self.ctx.term()
        for name in ("kvd.sock", "control.sock"):
            (self.runtime_dir / name).unlink(missing_ok=True)
        if self.service is not None:
            for engine in self.service.engines.values():
                engine.close()
        if self.arena is not None:
            self.arena.close()
        self.lock.release()

    async def _serve(self, sock, ops: dict, handler) -> None:
        max_bytes = sock.getsockopt(zmq.MAXMSGSIZE)
        while True:
            parts, cred = await recv_request(sock)
            received = time.monotonic()
            if len(parts) < 2:
                continue
            task = asyncio.create_task(self._respond(sock, parts[0], parts[1:], ops, handler,
                                                     max_bytes, received, cred))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _respond(self, sock, peer: bytes, body: list, ops: dict, handler, max_bytes: int,
                       received: float, cred) -> None:
        t0 = time.perf_counter()
        started = time.monotonic()
        req_id, op = None, "invalid"
        try:
            req = wire.parse_request(body, ops)
            req_id, op = req.id, req.op
            size = sum(len(frame) for frame in body)
            if size > max_bytes:
                raise TooLarge(f"message of {size} bytes exceeds max_message_bytes ({max_bytes})")
            reply = wire.ok_reply(req_id, await handler(peer, req, cred))
        except wire.ProtocolError as exc:
            reply = wire.error_reply(exc.req_id, exc.code, str(exc))
            self.service.stats.error(op, exc.code)
        except ServerError as exc:
            reply = wire.error_reply(req_id, exc.code, str(exc))
            self.service.stats.error(op, exc.code)
        except Exception as exc:  # a bug must cost one request, never the daemon
            log.exception("internal error in %s", op)
            reply = wire.error_reply(req_id, "internal", f"{type(exc).__name__}: {exc}")
            self.service.stats.error(op, "internal")
        self.service.stats.add(f"op_{op}")
        self.service.stats.observe(op, time.perf_counter() - t0)
        await self._reply(sock, peer, reply)
        if log.isEnabledFor(logging.DEBUG):  # CLOCK_MONOTONIC: comparable with the client's
            log.debug("request %s: received %.6f, started %.6f, replied %.6f", op, received,
                      started, time.monotonic())

    async def _reply(self, sock, peer: bytes, reply: list) -> None:
        """Send a reply; a peer whose queue is full (it does not read) gets up to
        ``REPLY_PATIENCE_S`` before the reply is dropped and counted; a gone peer's is
        dropped at once."""
        give_up = time.monotonic() + REPLY_PATIENCE_S
        while True:
            try:
                await sock.send_multipart([peer, *reply], flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if time.monotonic() > give_up:
                    self.service.stats.add("replies_dropped")
                    log.warning("a reply was dropped: the client has not read its replies for "
                                "%.0f s", REPLY_PATIENCE_S)
                    return
                await asyncio.sleep(0.001)
            except zmq.ZMQError as exc:
                log.debug("reply to a gone peer dropped: %s", exc)
                return

    async def _engine_op(self, peer: bytes, req, cred):
        if self.stopping.is_set() and req.op not in ("bye", "heartbeat"):
            raise ShuttingDown("daemon is shutting down")
        return await self.service.handle(peer, req, cred)

    async def _control_op(self, peer: bytes, req, cred):
        return await control.handle(self.service, req.op)

    async def _reaper(self) -> None:
        period = min(1.0, self.cfg.heartbeat_interval_s / 2)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            self.service.expire(now)
            gone = []
            if self.probe_due is not None and now >= self.probe_due:
                self.probe_due = None
                gone = await self._probe_peers()
            stale = self.service.sessions.stale(self.cfg.client_timeout_s, now)
            for session, why in [*((s, "connection closed") for s in gone),
                                 *((s, "heartbeat timeout") for s in stale if s not in gone)]:
                task = asyncio.create_task(self.service.reap(session, why))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _probe_peers(self) -> list:
        """Sessions whose routing id has no connection any more (ROUTER_MANDATORY)."""
        gone = []
        for session in list(self.service.sessions.by_peer.values()):
            if session.closing:
                continue
            try:
                await self.engine_sock.send_multipart([session.peer, PROBE], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # its queue is full: it is there
            except zmq.ZMQError as exc:
                if exc.errno == errno.EHOSTUNREACH:
                    gone.append(session)
        return gone

    async def _watch_disconnects(self) -> None:
        """Note when a peer's connection to the engine socket closes (ZeroMQ's monitor
        names the file descriptor, not the session: the reaper does the rest)."""
        monitor = self.engine_sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await monitor.recv_multipart()
                # give a peer that reconnects at once (same routing id) time to come back
                self.probe_due = time.monotonic() + PROBE_DELAY_S
        finally:
            self.engine_sock.disable_monitor()
            monitor.close(linger=0)



def make_tiering(cfg, host: HostTier, arena_view):
    from kvd.tiers.disk import DiskTier
    from kvd.tiers.tiering import Tiering
    try:
        disk = DiskTier(cfg.disk_dir, cfg.disk_capacity, cfg.disk_io_threads, cfg.disk_queue_chunks)
    except OSError as exc:
        raise RuntimeError(f"cannot use disk_dir {cfg.disk_dir}: {exc}") from None
    return Tiering(host, disk, arena_view, cfg.disk_high_watermark, cfg.disk_min_hits)


def make_gds(cfg, tiering, cuda):
    """The GPU Direct Storage loader, or None with the log line saying why not."""
    why = ("there is no disk tier (disk_dir)" if tiering is None else
           "the CUDA backend is off" if cuda is None else None)
    if why is None:
        from kvd.cuda.gds import GdsLoader, open_gds
        kvikio, mode = open_gds(cfg.disk_io_threads)
        if kvikio is not None:
            log.info("GPU Direct Storage on (%s)", mode)
            return GdsLoader(kvikio, mode, tiering.disk, cfg.disk_gds_slot_bytes)
        why = mode
    log.warning("disk_gds is on but GPU Direct Storage is unavailable: %s; disk chunks load "
                "through the host tier", why)
    return None


def make_cuda_engine(cfg, arena_view):
    """The CUDA backend, or None when it is off or unavailable (``gpu = "on"``: an error)."""
    if cfg.gpu == "off":
        return None
    try:
        from kvd.cuda.backend import CudaCopyEngine
        engine = CudaCopyEngine(arena_view, cfg.gpu_max_blocks, cfg.gpu_stage_slots,
                                cfg.gpu_stage_slot_bytes)
        if not engine.uuid_to_ordinal:
            raise RuntimeError("no CUDA device visible")
    except Exception as exc:  # ImportError without cupy, CUDA errors without a driver
        if cfg.gpu == "on":
            raise RuntimeError(f"gpu = on but the CUDA backend is unavailable: {exc}") from None
        log.info("CUDA backend off: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    log.info("CUDA backend on: %d GPU(s) visible", len(engine.uuid_to_ordinal))
    return engine


def serve(cfg) -> int:
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s kvd %(levelname)s %(message)s")
    daemon = Daemon(cfg)
    try:
        _run(daemon.main())
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    finally:
        daemon.close()
    log.info("stopped")
    return 0


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop not installed; using the default asyncio loop")
        asyncio.run(coro)
        return
    uvloop.run(coro)
