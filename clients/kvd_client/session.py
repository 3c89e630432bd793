"""The client's session with the daemon: hello, blocking calls, failures, close.

``ClientSession`` holds the connection state that ``KvdClient`` (kvd_client.client) builds
registrations, lookups and transfers on; replies are collected by the pump
(kvd_client.pump). Unavailability (down, slow, busy, no space, deadline, failed copy)
degrades to a miss; contract errors (``bad_request``, ``out_of_range``, ``forbidden``,
``too_large``, version) always raise (``raise_errors=True``: everything). Connects lazily;
a background thread heartbeats, ends late transfers, fences failed loads and, after a
daemon restart, says hello, re-registers and resends per its ``Retry``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Self

from kvd_protocol import wire
from kvd_protocol.errors import (
    BadRequest,
    DaemonUnavailable,
    Forbidden,
    KvdError,
    NoSession,
    OutOfRange,
    Timeout,
    TooLarge,
    UnknownOp,
    VersionMismatch,
)
from kvd_protocol.runtime import engine_endpoint, resolve_runtime_dir

from .liveness import DaemonProbe
from .pump import Pump
from .registration import Call, KVRegistration
from .retry import Retry
from .transfer import Transfer
from .transport import Channel

log = logging.getLogger("kvd_client")
CONTRACT_ERRORS = (BadRequest, OutOfRange, Forbidden, TooLarge, VersionMismatch, UnknownOp)


class ClientSession:
    def __init__(self, runtime_dir: str | None = None, timeout: float = 5.0,
                 raise_errors: bool = False, name: str | None = None, heartbeat: bool = True,
                 spin_s: float = 0.0, retry: Retry | None = None, load_slots: int = 64,
                 fence_quiet_s: float = 1.0, shm_dir: str = "/dev/shm"):
        self.runtime_dir = resolve_runtime_dir(runtime_dir)
        self.timeout = timeout
        self.raise_errors = raise_errors
        self.name = name or f"kvd_client:{os.getpid()}"
        self.retry = retry or Retry()
        self.load_slots, self.fence_quiet_s, self.shm_dir = load_slots, fence_quiet_s, shm_dir
        self.channel = Channel(engine_endpoint(self.runtime_dir), timeout, spin_s)
        self.probe = DaemonProbe(self.runtime_dir)
        self.limits: dict = {}
        self.connected = False
        self.registrations: list[KVRegistration] = []
        self._lock = threading.RLock()
        self._hello_lock = threading.Lock()
        self._hello_thread: int | None = None
        self._pending: dict[int, object] = {}  # request id -> Transfer | Lookup | Call
        self._finished: list[Transfer] = []    # submitted transfers done since the last poll
        self._stray_leases: list[int] = []     # leases of lookups nobody reads: to release
        self.lookups_unanswered = False        # a lookup passed its deadline; no reply since
        self._need_hello = False
        self._hellos = 0  # hellos answered so far: which session a request was sent under
        self._last_ok = 0.0
        self._pump = Pump(self)
        self._closed = threading.Event()
        self._heartbeat = heartbeat
        self._keeper = None

    # ---- session ----------------------------------------------------------------

    def connect(self) -> Self:
        """Say hello now if the daemon is there (else later, by itself) and start the
        background thread. Raises only with ``raise_errors``."""
        try:
            self._hello()
        except KvdError as exc:
            if self.raise_errors or isinstance(exc, CONTRACT_ERRORS):
                raise
            log.warning("kvd not reachable yet (%s); calls are misses until it is", exc)
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._pump.keep, name="kvd-client", daemon=True)
            self._keeper.start()
        return self

    @property
    def chunk_tokens(self) -> int:
        if not self.limits:
            self._hello()
        return self.limits["chunk_tokens"]

    def _hello(self) -> None:
        with self._hello_lock:
            if self.connected and not self._need_hello:
                return  # another thread said hello while this one waited for the lock
            if self.probe.gone(None):  # no daemon holds the lock: waiting for a reply is futile
                raise DaemonUnavailable(f"no kvd is running in {self.runtime_dir}")
            self._hello_thread = threading.get_ident()
            try:
                limits = self._call("hello", {"client": self.name, "pid": os.getpid(),
                                              "versions": [wire.VERSION]})
                with self._lock:
                    self.limits, self.connected, self._need_hello = limits, True, False
                    self._hellos += 1
                for reg in list(self.registrations):
                    self._register(reg)
                self._last_ok = time.monotonic()
            finally:
                self._hello_thread = None

    def _register(self, reg: KVRegistration) -> None:
        result = self._call("register" if reg.pool else "attach", reg.wire(self.runtime_dir, self.timeout))
        reg.id, reg.pages_per_chunk = result["reg"], result.get("pages_per_chunk", 0)
        if reg.namespace.chunk_tokens != self.limits["chunk_tokens"]:  # registered before hello
            reg.namespace = replace(reg.namespace, chunk_tokens=self.limits["chunk_tokens"])

    def _call(self, op: str, fields: dict, frames=(), timeout: float | None = None,
              send_wait: float | None = None):
        """One blocking request: its result, or its error raised. ``send_wait``: how long
        to wait for the daemon to take it (default: ``timeout``)."""
        timeout = self.timeout if timeout is None else timeout
        call = Call()
        req_id, sent_under = self._send_call(call, op, fields, frames,
                                             timeout if send_wait is None else send_wait)
        end = time.monotonic() + timeout
        while not call.done:
            left = end - time.monotonic()
            if left <= 0:
                with self._lock:
                    self._pending.pop(req_id, None)
                self.channel.forget(req_id)
                raise Timeout(f"kvd did not answer {op} within {timeout:g} s")
            self.progress(None, left)
        if call.error is not None:
            if isinstance(call.error, NoSession):
                self._pump.session_lost(sent_under)
            raise call.error
        self._last_ok = time.monotonic()
        return call.result

    def _send_call(self, item, op: str, fields: dict, frames, wait: float) -> tuple[int, int]:
        """Send a request whose reply the pump routes to ``item.resolve``; returns its id
        and the hello count it was sent under. Waits up to ``wait`` for the daemon to take it."""
        with self._lock:  # registered before any thread can collect its reply
            req_id, sent_under = self.channel.reserve_id(), self._hellos
            self._pending[req_id] = item
        try:
            self.channel.send(op, fields, frames, wait=wait, req_id=req_id)
        except BaseException:
            with self._lock:
                self._pending.pop(req_id, None)
            raise
        return req_id, sent_under

    def _ensure_connected(self) -> None:
        if self._need_hello or not self.connected:
            if self._hello_thread == threading.get_ident():
                return  # inside hello already
            self._hello()

    def close(self) -> None:
        self._closed.set()
        if self.connected:
            try:
                self._call("bye", {}, timeout=min(self.timeout, 1.0))
            except KvdError:
                pass
        for reg in self.registrations:
            if reg.flags is not None:
                reg.flags.close()
        self.channel.close()

    def __enter__(self):
        return self.connect()

    def __exit__(self, *exc):
        self.close()

    def _guard(self, call, fallback):
        try:
            return call()
        except KvdError as exc:
            if self.raise_errors or isinstance(exc, CONTRACT_ERRORS):
                raise
            log.warning("kvd unavailable, treating as a miss: %s", exc)
            return fallback

    # ---- progress: the pump (kvd_client.pump) does the work ----------------------

    def progress(self, target=None, timeout: float | None = None) -> None:
        """Collect replies (waiting up to ``timeout`` for one), end transfers past their
        deadline, fence failed loads, notice a dead daemon; resend after a restart."""
        self._pump.progress(target, timeout)
