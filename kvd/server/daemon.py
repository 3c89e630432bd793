"""``kvd serve``: start-up, the two ROUTER sockets, reaping, and shutdown.

Start-up, cheapest first: log the resolved config (kvd.server.config_log:
the knobs, and a warning for each misspelt ``KVD_*`` variable), resolve
``access_group``, check every cheap thing (kvd.server.startup: runtime dir,
shm_dir, disk_dir, room for the host tier and the disk tier, the metrics
library; exit status 2 with one line for a bad value), lock the runtime dir,
reclaim what a dead daemon left, open the disk tier, adopt the host tier a
previous daemon left or allocate a new one on threads (kvd.server.host_tier;
progress in the log and in systemd's STATUS=), start the backends, bind
``kvd.sock`` (engines) and ``control.sock`` (operators) under umask 077,
then tell systemd READY=1 (kvd.server.notify; WATCHDOG=1 from the loop when
systemd asks for it).
With ``access_group`` the runtime dir and sockets are opened to that group
(kvd.server.runtime_dir); every connection is admitted or refused by its
kernel peer credentials (kvd.server.peers) before any of its messages is
read, and each request carries its connection's credentials. The
``/metrics`` endpoint starts when ``metrics_port`` or ``metrics_socket`` is
set (kvd.server.metrics), on the loop. The open files limit is raised to its
hard limit first: engines, metrics peers and disk IO each take a descriptor,
and libzmq aborts the process when it cannot get one.
SIGTERM/SIGINT during start-up abandon it at once (the allocation stops
between pieces), remove what was made and exit 0 with one line.

Each request runs as its own task so a slow copy never blocks other
clients; every reply goes back through the socket it came from
(kvd.server.peers_alive: slow readers, probes of gone peers, reaping). Each
socket caps the requests of one peer being served (engines: ``max_inflight``;
control: ``CONTROL_INFLIGHT``, with ``CONTROL_REPLY_QUEUE`` replies queued):
past it a request gets ``busy`` at once, so an operator tool that never reads
its replies cannot grow the daemon. A
request that fails validation gets a typed error reply; a peer that sends a
frame larger than ``max_message_bytes`` is dropped by ZeroMQ (its limit is
per frame), and a message whose frames together exceed it gets a
``too_large`` reply and is not run. A request that fails validation, and an
internal error, are logged at most once per peer per 10 s
(kvd.server.logs.PeerLimiter). With ``disk_dir`` set, the disk tier
(kvd.tiers.disk.tiering) starts with the loop and scans its directory in the
background; with ``remote_backend`` set, the remote tier (kvd.tiers.remote.tier)
starts local-only and connects in the background. SIGTERM/SIGINT: stop
reading, end every request waiting on a client (``shutting_down``), let the
others (and their copies) finish and finish disk and remote tier IO within
``shutdown_grace_s`` in all (copies still queued then are abandoned: the
CUDA backend's close gives the GPU a bounded wait of its own), remove the
sockets, keep the host tier for the next start (``warm_restart``), exit 0:
bounded whatever the GPU or the clients do, since no copy waits on another
process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import threading
import time
from pathlib import Path

import zmq
import zmq.asyncio

from kvd import __version__
from kvd.copy.host import HostCopyEngine
from kvd.server import control, early_signals, logs, metrics, startup
from kvd.server.config_log import log_config
from kvd.server.host_tier import HostTierSetup
from kvd.server.load_verify import LoadVerifier
from kvd.server.notify import Notifier
from kvd.server.peers import AccessPolicy, ZapGate, credentials_available, recv_request, resolve_group
from kvd.server.peers_alive import Intake, Liveness, reply
from kvd.server.runtime_dir import InstanceLock, reclaim_stale, share_socket
from kvd.server.service import Service
from kvd.tiers.disk.tiering import Tiering
from kvd_protocol import wire
from kvd_protocol.errors import ConfigError, ServerError, ShuttingDown, TooLarge
from kvd_protocol.runtime import control_endpoint, engine_endpoint, instance_tag, resolve_runtime_dir

log = logging.getLogger("kvd")
REPLY_QUEUE = 65536  # a client pipelining hard gets its busy replies; one that never reads, not all
CONTROL_REPLY_QUEUE = 64  # replies queued per operator peer (stats replies are KBs each)
CONTROL_INFLIGHT = 4  # control requests of one peer being served; more get busy at once
YIELD_EVERY = 32  # messages read back to back before other tasks get a turn


class Daemon:
    def __init__(self, cfg, notifier: Notifier | None = None):
        self.cfg = cfg
        self.runtime_dir = resolve_runtime_dir(cfg.runtime_dir or None)
        self.lock = InstanceLock(self.runtime_dir)
        self.notifier = notifier or Notifier()
        self.stopping = asyncio.Event()
        self.abort = threading.Event()  # set with ``stopping``: work on threads checks it
        self.stop_signal, self.tasks = None, set()  # tasks: asyncio.Task the shutdown awaits
        self.host = HostTierSetup(cfg, self.runtime_dir, self.notifier, self.abort)
        self.disk = self.service = self.ctx = None
        self.sockets = []
        self.metrics = None  # the /metrics server (kvd.server.metrics), when one is configured
        self.group = None  # gid engines of other users connect with (access_group): start()
        self.gate = None  # kvd.server.peers.ZapGate: admits connections by their peer credentials
        self.liveness = Liveness(self)
        self.intake = self.control_intake = None  # kvd.server.peers_alive.Intake, per socket
        self.deadline = None  # set at shutdown: when everything must be done
        self.malformed = logs.PeerLimiter()  # one line per peer per 10 s for requests
        self.internal = logs.PeerLimiter()  # that fail validation, and for internal errors

    def _on_signal(self, sig: signal.Signals) -> None:
        self.stop_signal = self.host.stop_signal = self.stop_signal or sig.name
        self.abort.set()
        self.stopping.set()

    async def main(self) -> bool:
        """Start, serve until a signal, shut down. False when a signal ended start-up."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # before anything is made: see _allocate
            loop.add_signal_handler(sig, self._on_signal, sig)
        if early_signals.pending() is not None:  # arrived before these handlers
            self._on_signal(early_signals.pending())
        watchdog = asyncio.create_task(self._watchdog()) if self.notifier.watchdog_s else None
        try:
            if not await self.start():
                return False
            await self.run()
            return True
        finally:
            await self._finish_disk_io()
            await self.host.drain(self._left())
            if watchdog is not None:
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)

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
        old = os.umask(0o077)
        try:  # fds.sock first: an engine that reconnects at once lends its descriptors there
            startup.open_fd_intake(self.service, cuda, self.runtime_dir, self.group)
            self.engine_sock = self._bind(engine_endpoint(self.runtime_dir), self.cfg.max_message_bytes,
                                          REPLY_QUEUE)
            self.intake = Intake(self.engine_sock, self.cfg.max_inflight, lambda: self.service.stats)
            self.control_sock = self._bind(control_endpoint(self.runtime_dir), wire.MAX_HEADER_BYTES,
                                           CONTROL_REPLY_QUEUE)
            self.control_intake = Intake(self.control_sock, CONTROL_INFLIGHT,
                                         lambda: self.service.stats, "per control peer")
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

    def _bind(self, endpoint: str, max_bytes: int, reply_queue: int):
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its routing id
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer fails: see peers_alive
        sock.setsockopt(zmq.SNDHWM, reply_queue)  # replies queued per client before it must read
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

    def spawn(self, coro) -> asyncio.Task:
        """A task the shutdown waits for."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def run(self) -> None:
        readers = [asyncio.create_task(self._serve(self.engine_sock, wire.OPS, self._engine_op)),
                   asyncio.create_task(self._serve(self.control_sock, wire.CONTROL_OPS, self._control_op)),
                   asyncio.create_task(self.liveness.reap_loop()),
                   asyncio.create_task(self.liveness.watch_disconnects())]
        if self.gate is not None:
            readers.append(asyncio.create_task(self.gate.serve()))
        if self.service.tiering is not None:
            self.service.tiering.start()  # recovery scan runs in the background
        self.host.start_verify()  # after a crash: checksums, in the background
        if self.service.remote is not None:
            self.service.remote.start()  # connects in the background: local-only until then
        await self.stopping.wait()
        self.deadline = time.monotonic() + self.cfg.shutdown_grace_s
        log.info("shutting down (%s): finishing %d requests in flight (at most %.1f s)",
                 self.stop_signal, len(self.tasks), self.cfg.shutdown_grace_s)
        self.notifier.stopping(f"shutting down: finishing {len(self.tasks)} requests in flight")
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        self.service.stop_waiting()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=max(0.0, self.deadline - time.monotonic()))
        if self.tasks and (abandoned := self.service.abandon_copies()):
            # a request whose copy never lands would hold the loop's teardown; the engines'
            # close gives the GPU its own bounded wait (kvd.cuda.backend.CLOSE_WAIT_S)
            log.warning("%d copies still queued after shutdown_grace_s; not waiting for them",
                        abandoned)
            await asyncio.wait(self.tasks, timeout=1.0)

    def _left(self) -> float:
        """Seconds left of the shutdown grace (60 when start-up did not get to serving)."""
        return 60.0 if self.deadline is None else max(0.1, self.deadline - time.monotonic())

    def remote_left_open(self) -> bool:
        remote = None if self.service is None else self.service.remote
        return remote is not None and not remote.remote.closed

    async def _finish_disk_io(self) -> None:
        """Disk and remote tier IO finish before the arena goes, within what is left of the
        grace (remote calls stuck in a dead store are abandoned; a zero-copy one still points
        into the arena, whose mapping the remote tier's view keeps until the process ends)."""
        left = self._left()
        try:
            if self.service is not None and self.service.remote is not None:
                await asyncio.wait_for(self.service.remote.stop(), left)
            if self.service is not None and self.service.tiering is not None:
                await asyncio.wait_for(self.service.tiering.stop(), left)
            elif self.disk is not None:
                await asyncio.wait_for(self.disk.close(), left)
        except asyncio.TimeoutError:
            log.warning("disk IO still running after shutdown_grace_s; exiting anyway")

    def close(self) -> None:
        if self.lock.fd < 0:
            return  # never owned the runtime dir: touch nothing in it
        if self.metrics is not None:
            self.metrics.close()
        for sock in self.sockets:
            sock.close(linger=0)
        if self.gate is not None:
            self.gate.close()
        if self.ctx is not None:
            self.ctx.term()
        for name in ("kvd.sock", "control.sock"):
            (self.runtime_dir / name).unlink(missing_ok=True)
        if self.service is not None:
            if self.service.fd_intake is not None:
                self.service.fd_intake.close()
            for engine in dict.fromkeys(self.service.engines.values()):  # one engine, two kinds
                engine.close()
            if self.service.transfers.verifier is not None:
                self.service.transfers.verifier.close()
        self.host.close(served=bool(self.sockets))
        self.lock.release()

    async def _serve(self, sock, ops: dict, handler) -> None:
        max_bytes = sock.getsockopt(zmq.MAXMSGSIZE)
        admit = self.intake if sock is self.engine_sock else self.control_intake
        for n in itertools.count(1):
            if n % YIELD_EVERY == 0:  # a read that finds a message ready never yields by itself
                await asyncio.sleep(0)
            parts, cred = await recv_request(sock)
            received = time.monotonic()
            if len(parts) < 2 or not admit.take(parts):
                continue
            task = self.spawn(self._respond(sock, parts[0], parts[1:], ops, handler, max_bytes,
                                            received, cred))
            admit.track(parts[0], task)

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
            frames = wire.ok_reply(req_id, await handler(peer, req, cred))
        except wire.ProtocolError as exc:
            frames = wire.error_reply(exc.req_id, exc.code, str(exc))
            self.service.stats.error(op, exc.code)
            self.malformed.log(log, logging.WARNING, (ops is wire.OPS, peer), "malformed request "
                               "from %s: %s: %s", logs.peer_name(peer, cred), exc.code, exc)
        except ServerError as exc:
            frames = wire.error_reply(req_id, exc.code, str(exc))
            self.service.stats.error(op, exc.code)
        except Exception as exc:  # a bug must cost one request, never the daemon (nor its log)
            self.internal.log(log, logging.ERROR, (ops is wire.OPS, peer), "internal error in "
                              "%s (request from %s)", op, logs.peer_name(peer, cred), exc_info=True)
            frames = wire.error_reply(req_id, "internal", f"{type(exc).__name__}: {exc}")
            self.service.stats.error(op, "internal")
        self.service.stats.add(f"op_{op}")
        self.service.stats.observe(op, time.perf_counter() - t0)
        await reply(sock, peer, frames, self.service.stats)
        if log.isEnabledFor(logging.DEBUG):  # CLOCK_MONOTONIC: comparable with the client's
            log.debug("request %s: received %.6f, started %.6f, replied %.6f", op, received,
                      started, time.monotonic())

    async def _engine_op(self, peer: bytes, req, cred):
        if self.stopping.is_set() and req.op not in ("bye", "heartbeat"):
            raise ShuttingDown("daemon is shutting down")
        return await self.service.handle(peer, req, cred)

    async def _control_op(self, peer: bytes, req, cred):
        return await control.handle(self.service, req.op)



def serve(cfg) -> int:
    """Run the daemon until SIGTERM/SIGINT: exit status 0 (also when a signal ended start-up),
    2 for a config problem found at start-up, 1 when start-up failed otherwise."""
    logs.setup(cfg.log_level, cfg.log_format)
    log.info("kvd %s starting, pid %d", __version__, os.getpid())
    startup.raise_fd_limit()
    log_config(cfg)
    notifier = Notifier.from_env()
    daemon = Daemon(cfg, notifier)
    try:
        served = _run(daemon.main())
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return 2
    except RuntimeError as exc:  # StartupError and the arena's own: one line each
        log.error("%s", exc)
        return 1
    finally:
        early_signals.record()  # the loop's handlers are gone: a signal must not cut this short
        daemon.close()
        notifier.close()
    if served:
        log.info("stopped")
    if daemon.remote_left_open():
        _exit_now(0)
    return 0


def _exit_now(code: int) -> None:
    """End the process without running exit handlers and library destructors: a store client
    that could not be closed (a call stuck in it, its server gone) aborts in them (Mooncake:
    std::terminate on its joinable threads). Everything of ours is released by now."""
    log.warning("exiting without the remote store client's exit handlers (it could not be "
                "closed)")
    logging.shutdown()
    os._exit(code)


def _run(coro):
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop not installed; using the default asyncio loop")
        return asyncio.run(coro)
    return uvloop.run(coro)
