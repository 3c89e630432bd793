"""Remote tier IO: calls to a distributed store that never make a request slow.

Every store call (kvd/tiers/remote/store.py) runs on one of ``threads``
daemon threads (kvd/tiers/daemon_threads.py) and is awaited for at most
``timeout_s`` (calls that carry a payload: plus its size at
``FLOOR_BYTES_S``); a call past it is abandoned, counted as a timeout, and
its result, if one ever comes, is dropped. A circuit breaker
(kvd/tiers/remote/breaker.py) sits in front: ``breaker_failures`` consecutive
errors or timeouts open it, and while open every call is refused at once
(counted as ``skipped``): kvd serves from its local tiers only. A probe
task connects, pings and puts a small probe value every ``breaker_retry_s``
while open and closes it when all of that worked; the breaker starts open,
so start-up never waits on the store. When every thread is taken (calls
stuck in a dying store), a call is refused at once (``busy``) instead of
queueing behind them.

Payload work (packing values, verifying them, copying into host slots) runs
on separate CPU threads, never behind network calls, and is always waited
for: it touches the arena. Checksums hold the GIL (xxhash), so ``start``
lowers the interpreter's switch interval to ``SWITCH_S`` for the process's
life: other threads wait for the GIL a fraction of a millisecond, not 5 ms.
Failures are never raised to requests: ``exists_prefix`` returns 0, ``get``
None, ``put`` None. ``known`` remembers (bounded, LRU) the names this node
saw present, so chunks are not put twice; ``bad`` those dropped as corrupt
(no hit for ``BAD_HOLD_S``: a bad value is fetched and counted once).
``put_from``/``get_into``: the zero-copy calls of a store that has them
(Mooncake, kvd/tiers/remote/mooncake.py), several values' payloads between
registered arena memory and the store in one call, each value's outcome its
own; ``on_done`` tells when the thread left the call (an abandoned call may
still read or write that memory until then). Runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections import Counter, OrderedDict

from kvd.tiers.daemon_threads import DaemonThreads
from kvd.tiers.remote.breaker import Breaker
from kvd.tiers.remote.value import store_name

log = logging.getLogger("kvd")
PROBE_PERIOD_S = 0.05
FLOOR_BYTES_S = 1e9  # a store slower than 8 Gb/s for one value is treated as failing
KNOWN_NAMES = 1 << 16
CPU_THREADS = 2
PROBE_VALUE = b"kvd probe"
BAD_HOLD_S = 10.0  # a value dropped as corrupt is no hit here for this long (its delete may lag)
CLOSE_TIMEOUT_S = 5.0
# a thread waiting for the GIL gets it within this (CPython's default, 5 ms, stalls the loop
# and every network thread returning from the store while a CPU thread checks a payload)
SWITCH_S = 0.0002  # Mooncake unmounts this node's segment from the master on close: ~1-2 s


class RemoteUnavailable(Exception):
    """A call refused (breaker open, threads busy) or failed; counted already."""


class RemoteTier:
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

    def name(self, ns: bytes, key: bytes) -> str:
        return store_name(self.prefix, ns, key)

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

    # ---- operations --------------------------------------------------------------------

    async def exists_prefix(self, ns: bytes, keys: list) -> int:
        """How many of ``keys``, in order, the store holds (0 when it cannot say now)."""
        names = [self.name(ns, k) for k in keys]
        try:
            found = await self.call(self.store.exists, names)
        except RemoteUnavailable:
            return 0
        now = time.monotonic()
        n = next((i for i, (there, name) in enumerate(zip(found, names))
                  if not there or self.bad.get(name, 0) > now), len(found))
        for name in names[:n]:
            self.remember(name)
        self.counters["exists_calls"] += 1
        return n

    async def get(self, ns: bytes, key: bytes, nbytes: int = 0):
        """The stored value (unverified bytes), or None (absent, or the store failed)."""
        name = self.name(ns, key)
        try:
            value = await self.call(self.store.get, name, nbytes=nbytes)
        except RemoteUnavailable:
            return None
        self._got(name, value)
        return value

    async def present(self, names: list):
        """Which of ``names`` the store holds (one round trip); None when it cannot say."""
        try:
            return await self.call(self.store.exists, names)
        except RemoteUnavailable:
            return None

    def there(self, name: str) -> None:
        """A put found ``name`` in the store already (another node sent it)."""
        self.remember(name)
        self.counters["puts_present"] += 1

    async def get_many(self, ns: bytes, keys: list, nbytes: int = 0) -> list:
        """The stored values of ``keys`` (each unverified bytes or None), one round trip
        (the store's ``get_many``); all None when the store failed."""
        try:
            values = await self.call(self.store.get_many, [self.name(ns, k) for k in keys],
                                     nbytes=nbytes)
        except RemoteUnavailable:
            return [None] * len(keys)
        for key, value in zip(keys, values):
            self._got(self.name(ns, key), value)
        return values

    def _got(self, name: str, value) -> None:
        if value is None:
            self.counters["gets_missing"] += 1
            self.forget(name)
        else:
            self.counters["gets"] += 1
            self.counters["get_bytes"] += value if isinstance(value, int) else len(value)

    async def put(self, ns: bytes, key: bytes, value, checked: bool = False):
        """Store ``value`` unless the store has the chunk already (``checked``: the caller
        asked, ``present``): True when it was sent, False when it was there, None when
        the call failed (a call abandoned at its timeout may still read ``value``)."""
        name = self.name(ns, key)
        size = memoryview(value).nbytes
        try:
            sent = await self.call(self._put, name, value, checked, nbytes=size)
        except RemoteUnavailable:
            sent = None
        return self._put_result(name, sent, size)

    async def put_from(self, names: list, heads: list, ptrs: list, sizes: list,
                       checked: bool, on_done) -> list:
        """``put`` of values whose payloads are ``sizes[i]`` bytes of registered memory at
        ``ptrs[i]`` (the store's ``put_from``: one call for all, and one exists round trip
        first unless ``checked``), sent without a copy: per value True sent, False the store
        had it, None failed. ``on_done`` as ``call``'s: the payloads must stay as they are
        until then."""
        try:
            sent = await self.call(self._put_from, names, heads, ptrs, sizes, checked,
                                   nbytes=sum(sizes), on_done=on_done)
        except RemoteUnavailable:
            sent = [None] * len(names)
        out = []
        for name, head, size, one in zip(names, heads, sizes, sent):
            if isinstance(one, Exception):  # this value failed, others of the call did not
                self.counters["errors"] += 1
                self._note(one, "put_from")
                one = None
            self.counters["zero_copy_puts"] += one is True
            out.append(self._put_result(name, one, len(head) + size))
        return out

    def _put_result(self, name: str, sent: bool | None, nbytes: int) -> bool | None:
        """Count a put's outcome: None failed, False the store had it, True sent."""
        if sent is None:
            self.counters["puts_failed"] += 1
            return None
        if not sent:
            self.there(name)
            return False
        self.remember(name)
        self.counters["puts"] += 1
        self.counters["put_bytes"] += nbytes
        return True

    def _put_from(self, names: list, heads: list, ptrs: list, sizes: list,
                  checked: bool) -> list:
        there = [False] * len(names) if checked else self.store.exists(names)
        todo = [i for i, t in enumerate(there) if not t]
        out: list = [False] * len(names)
        if todo:
            for i, one in zip(todo, self.store.put_from(*([x[i] for i in todo] for x in
                                                          (names, heads, ptrs, sizes)))):
                out[i] = True if one is None else one
        return out

    async def get_into(self, ns: bytes, keys: list, head_len: int, ptrs: list, size: int,
                       on_done) -> list:
        """Values of ``keys``, one store call (the store's ``get_into``): per value its head,
        its payload fetched into registered memory at ``ptrs[i]``; None when absent or
        failed, an int (the stored size) when the value has another size. ``on_done`` as
        ``call``'s: the memory may be written until then."""
        names = [self.name(ns, k) for k in keys]
        try:
            heads = await self.call(self.store.get_into, names, head_len, ptrs, size,
                                    nbytes=size * len(names), on_done=on_done)
        except RemoteUnavailable:
            return [None] * len(names)
        out = []
        for name, head in zip(names, heads):
            if isinstance(head, Exception):  # this value failed, others of the call did not
                self.counters["errors"] += 1
                self._note(head, "get_into")
                head = None
            elif isinstance(head, bytes):
                self.counters["zero_copy_gets"] += 1
                self._got(name, len(head) + size)
            elif head is None:
                self._got(name, None)
            out.append(head)
        return out

    def _put(self, name: str, value, checked: bool) -> bool:
        if not checked and self.store.exists([name])[0]:  # another node put it: save the upload
            return False
        self.store.put(name, value)
        return True

    def dropped_corrupt(self, ns: bytes, key: bytes, why: str = "") -> None:
        """A value that failed verification: counted, forgotten, deleted from the store, and
        no hit of a lookup for ``BAD_HOLD_S`` (not fetched and counted again meanwhile)."""
        name = self.name(ns, key)
        self.counters["corrupt"] += 1
        self.forget(name)
        self.bad[name] = time.monotonic() + BAD_HOLD_S
        self.bad.move_to_end(name)
        if len(self.bad) > KNOWN_NAMES:
            self.bad.popitem(last=False)
        log.warning("remote chunk %s failed verification (%s): dropped", name, why or "corrupt")
        if self.breaker.allow():
            asyncio.ensure_future(self._delete(name))

    async def _delete(self, name: str) -> None:
        try:
            await self.call(self.store.delete, name)
        except RemoteUnavailable:
            pass

    def remember(self, name: str) -> None:
        self.known[name] = None
        self.known.move_to_end(name)
        if len(self.known) > KNOWN_NAMES:
            self.known.popitem(last=False)

    def forget(self, name: str) -> None:
        self.known.pop(name, None)

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

    def stats(self) -> dict:
        c = self.counters
        out = {"backend": self.store.name, "address": self.store.address, "prefix": self.prefix,
               "breaker": self.breaker.state, "breaker_opened": self.breaker.opened,
               "last_error": self.last_error, "threads_busy": self.net.busy,
               "zero_copy": getattr(self.store, "zero_copy", False)}
        return {**out, **{name: c[name] for name in (
            "exists_calls", "gets", "get_bytes", "gets_missing", "puts", "put_bytes",
            "puts_present", "puts_failed", "corrupt", "errors", "timeouts", "skipped", "busy",
            "probes", "probe_failures", "zero_copy_puts", "zero_copy_gets")}}


def _soon(loop, fn) -> None:
    """``fn()`` on ``loop`` from any thread; nothing when there is no ``fn`` or no loop."""
    if fn is not None:
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop closed: the process is ending
            pass
