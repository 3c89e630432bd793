"""How the remote tier calls a store: threads, timeouts, the breaker and its probe.

``StoreCalls`` runs every store call (kvd/tiers/remote/store.py) on one of ``threads``
daemon threads, awaited at most ``timeout_s`` (plus payload size at ``FLOOR_BYTES_S``); a
late call is abandoned, counted, its result dropped. A breaker (kvd/tiers/remote/breaker.py)
opens after ``breaker_failures`` consecutive failures: calls are refused at once (local
tiers only) until a probe every ``breaker_retry_s`` succeeds; it starts open, so start-up
never waits on the store. All threads taken: a call is refused (``busy``), never queued.
Payload work (packing, verifying, copying into host slots) runs on separate CPU threads
and is always waited for; ``start`` lowers the switch interval to ``SWITCH_S`` (xxhash holds
the GIL). ``RemoteTier`` (kvd/tiers/remote/tier.py) builds the tier's operations on these.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections import Counter, OrderedDict

from kvd.tiers.daemon_threads import DaemonThreads
from kvd.tiers.remote.breaker import Breaker

log = logging.getLogger("kvd")
PROBE_PERIOD_S = 0.05
FLOOR_BYTES_S = 1e9  # a store slower than 8 Gb/s for one value is treated as failing
CPU_THREADS = 2
PROBE_VALUE = b"kvd probe"
CLOSE_TIMEOUT_S = 5.0
# a thread waiting for the GIL gets it within this (CPython's default, 5 ms, stalls the loop
# and every network thread returning from the store while a CPU thread checks a payload)
SWITCH_S = 0.0002  # Mooncake unmounts this node's segment from the master on close: ~1-2 s


class RemoteUnavailable(Exception):
    """A call refused (breaker open, threads busy) or failed; counted already."""


class StoreCalls:
    def __init__(self, store, prefix: str, timeout_s: float, threads: int, breaker_failures: int,
                 breaker_retry_s: float, cpu_threads: int = CPU_THREADS):
        self.store = store
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.net = DaemonThreads(threads, "kvd-remote")
        self.cpu_threads = DaemonThreads(cpu_threads, "kvd-remote-cpu")
        self.breaker = Breaker(breaker_failures, breaker_retry_s)
        self.counters: Counter = Counter()
        self.known: OrderedDict[str, None] = OrderedDict()
        self.bad: OrderedDict[str, float] = OrderedDict()  # name: until when it is no hit
        self.last_error = ""
        self.node = os.urandom(6).hex()  # this daemon's probe value's name
        self.closed = False  # the client was closed by ``stop`` (see kvd.server.daemon.serve)
        self._cpu_jobs: set = set()
        self._prober = None

    # ---- the breaker and its probe -------------------------------------------------------

    def start(self) -> None:
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_S))  # for the daemon's life
        log.info("remote tier: %s at %s, prefix %r; local-only until it answers", self.store.name,
                 self.store.address, self.prefix)
        self._prober = asyncio.ensure_future(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            if self.breaker.probe_due():
                await self._probe()
            await asyncio.sleep(PROBE_PERIOD_S)

    async def _probe(self) -> None:
        self.counters["probes"] += 1
        try:  # connecting may take a few round trips
            await self._run(self._connect_and_ping, max(1.0, 3 * self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - any failure keeps the breaker open
            self.counters["probe_failures"] += 1
            self.breaker.failure()
            self._note(exc, "probe")
            return
        self.breaker.success()
        log.info("remote store %s at %s answers: remote tier on", self.store.name,
                 self.store.address)

    def _connect_and_ping(self) -> None:
        """Connected, answering, and taking values: a put and delete of a small probe value
        (a Mooncake master that just restarted answers before any node re-mounted memory,
        and every put fails until one did)."""
        self.store.connect()
        self.store.ping()
        name = f"{self.prefix}/probe/{self.node}"
        self.store.put(name, PROBE_VALUE)
        self.store.delete(name)

    def _note(self, exc: BaseException, what: str) -> None:
        text = f"{what}: {type(exc).__name__}: {exc}" if str(exc) else f"{what}: {type(exc).__name__}"
        if text != self.last_error:
            log.warning("remote store %s: %s", self.store.address, text)
        self.last_error = text

    async def _run(self, fn, timeout: float, *args, on_done=None):
        loop = asyncio.get_running_loop()
        try:
            job = self.net.submit(fn, *args)
        except BaseException:
            _soon(loop, on_done)
            raise
        if on_done is not None:
            job.add_done_callback(lambda _: _soon(loop, on_done))
        return await asyncio.wait_for(asyncio.wrap_future(job), timeout)

    async def call(self, fn, *args, nbytes: int = 0, on_done=None):
        """``fn(*args)`` on a network thread, through the breaker, within the timeout.
        ``on_done()`` runs on the loop exactly once, when ``fn`` returned (also after the
        call was abandoned at its timeout), or at once when the call was refused."""
        if not self.breaker.allow():
            self.counters["skipped"] += 1
            _soon(asyncio.get_running_loop(), on_done)
            raise RemoteUnavailable("breaker open")
        if self.net.busy >= self.net.size:
            self.counters["busy"] += 1
            _soon(asyncio.get_running_loop(), on_done)
            raise RemoteUnavailable("every remote thread is busy")
        try:
            result = await self._run(fn, self.timeout_s + nbytes / FLOOR_BYTES_S, *args,
                                     on_done=on_done)
        except TimeoutError:
            self.counters["timeouts"] += 1
            self._failed(TimeoutError(f"no answer within {self.timeout_s:g} s"), fn)
        except Exception as exc:  # noqa: BLE001 - a store client raises anything; all are failures
            self.counters["errors"] += 1
            self._failed(exc, fn)
        else:
            self.breaker.success()
            return result
        raise RemoteUnavailable(self.last_error)

    def _failed(self, exc: BaseException, fn) -> None:
        self._note(exc, getattr(fn, "__name__", "call"))
        if self.breaker.failure():
            log.warning("remote store %s: circuit breaker open after %d failures: local-only, "
                        "probing every %g s", self.store.address, self.breaker.threshold,
                        self.breaker.retry_s)

    async def cpu(self, fn, *args):
        """``fn(*args)`` on a CPU thread; waited for even when the caller is cancelled (it may
        touch host slots the caller gives back after)."""
        fut = asyncio.wrap_future(self.cpu_threads.submit(fn, *args))
        self._cpu_jobs.add(fut)
        fut.add_done_callback(self._cpu_jobs.discard)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.gather(fut, return_exceptions=True)
            raise

    async def stop(self) -> None:
        """Stop probing, wait for payload work (it touches the arena) and, a few seconds at
        most, for calls in flight, then close the client; ``closed`` says whether it was
        (not when a call is stuck in it or the store is gone)."""
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)
        await asyncio.gather(*list(self._cpu_jobs), return_exceptions=True)
        self.cpu_threads.close()
        deadline = asyncio.get_running_loop().time() + CLOSE_TIMEOUT_S
        while self.net.busy and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)  # calls a dying store holds return within its own timeouts
        try:
            if self.net.busy:
                raise RemoteUnavailable(f"{self.net.busy} calls are still stuck in it")
            await self._run(self.store.close, CLOSE_TIMEOUT_S)
            self.closed = True
        except Exception as exc:  # noqa: BLE001 - closing is best effort
            log.warning("remote store client not closed: %s: %s", type(exc).__name__, exc)
        self.net.close()



def _soon(loop, fn) -> None:
    """``fn()`` on ``loop`` from any thread; nothing when there is no ``fn`` or no loop."""
    if fn is not None:
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop closed: the process is ending
            pass
