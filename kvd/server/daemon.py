"""``kvd serve``: the two ROUTER sockets, the request loop, reaping, and shutdown.

Start-up (checks, tiers, backends, sockets, READY=1) is kvd/server/daemon_start.py
(``DaemonStart``, which ``Daemon`` extends). Each request runs as its own task, answered on
its own socket; per-peer in-flight caps answer ``busy`` (the control socket's through
kvd.server.backlog, never dropped); oversized messages ``too_large``; bad requests a typed
error. Lines a peer causes are rate-limited per kernel (uid, pid). SIGTERM/SIGINT: stop
reading, end waits on clients, finish copies and tier IO within ``shutdown_grace_s``, keep
the host tier for a warm restart, exit 0: bounded whatever the GPU or clients do. Request
flow: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import threading
import time

import zmq
import zmq.asyncio

from kvd import __version__
from kvd.printable import printable
from kvd.server import control, early_signals, logs, startup
from kvd.server.config_log import log_config
from kvd.server.daemon_start import DaemonStart
from kvd.server.host_tier import HostTierSetup
from kvd.server.notify import Notifier
from kvd.server.peers import recv_request
from kvd.server.peers_alive import Liveness, reply
from kvd.server.runtime_dir import InstanceLock
from kvd_protocol import wire
from kvd_protocol.errors import ConfigError, ServerError, ShuttingDown, TooLarge
from kvd_protocol.runtime import resolve_runtime_dir

log = logging.getLogger("kvd")
YIELD_EVERY = 32  # messages read back to back before other tasks get a turn


class Daemon(DaemonStart):
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
        self.internal = logs.PeerLimiter()  # one line per peer per 10 s for internal errors
        self.caps = []  # kvd.server.connections.ConnectionCap, per socket

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
                   *(asyncio.create_task(cap.serve()) for cap in self.caps)]
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
            # close gives the GPU its own bounded wait (kvd.cuda.devices.CLOSE_WAIT_S)
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
        for cap in self.caps:
            cap.close()
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
            self.service.peer_log.log(log, logging.WARNING, logs.peer_key(peer, cred), "malformed "
                                      "request from %s: %s: %s", logs.peer_name(peer, cred),
                                      exc.code, printable(str(exc), 256))
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
