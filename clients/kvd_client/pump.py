"""The client's engine room: sending transfers, routing replies, deadlines, fences.

``Pump(client)``, composed into ``KvdClient``: ``start``/``start_lookup`` send (hello first
when needed); ``progress(target, timeout)`` routes replies to their ``Transfer``, ``Lookup``
or blocking call, then fails transfers past their deadline (``Timeout``), cancels failed
loads and fences them (done word, daemon gone, or ``fence_quiet_s``), and probes the
daemon's instance lock so a dead daemon fails everything at once. ``no_session`` answers
are resent after hello per ``Retry``. ``keep()`` is the background thread's body. State is
under the client's lock; nobody sleeps holding it.
"""

from __future__ import annotations

import logging
import time

from kvd_protocol import wire
from kvd_protocol.errors import DaemonUnavailable, KvdError, NoSession, Timeout, TooLarge

from .lookup import Lookup
from .registration import engine_stream, next_seq
from .transfer import Transfer

log = logging.getLogger("kvd_client")
NOT_QUEUED = {"busy", "no_session", "bad_request", "bad_version", "unknown_op", "not_found",
              "forbidden", "out_of_range", "too_large", "shutting_down"}
KEEPER_PERIOD_S = 0.02  # housekeeping while transfers are pending
PROBE_PERIOD_S = 0.05   # daemon liveness checks while transfers are pending
SEND_WAIT_S = 0.5       # longest a transfer waits for the daemon to take it


class Pump:
    def __init__(self, client):
        self.c = client
        self.fencing: list[Transfer] = []
        self.resend: list[Transfer] = []
        self.waiters = 0
        self.last_probe = 0.0

    # ---- sending --------------------------------------------------------------------

    def start(self, t: Transfer) -> None:
        if not t.keys:
            self._finish_unsent(t, None)
            return
        self._mark(t)
        try:
            self.c._ensure_connected()
            self._send(t)
        except KvdError as exc:
            self._finish_unsent(t, exc)

    def _mark(self, t: Transfer) -> None:
        """CUDA pools: the daemon copies once the engine's stream got here (a store's KV
        is written; the last kernels that used a load's pages are done); at once if it
        already ran everything queued on it."""
        stream = engine_stream(t.reg.pool)
        if stream is not None and not t.reg.flags.stream_idle(stream):
            t.reg.mark_seq = next_seq(t.reg.mark_seq)
            t.reg.flags.mark(stream, t.reg.mark_seq)
            t.after = t.reg.mark_seq

    def start_lookup(self, lookup: Lookup) -> None:
        """Send a lookup without waiting; one that cannot be sent is done at once (a miss)."""
        c = self.c
        try:
            if not lookup.keys:
                with c._lock:
                    lookup.resolve({"hits": 0, "lease": None}, None)
                return
            if c.lookups_unanswered:  # a hung daemon costs one deadline, not one per lookup
                raise DaemonUnavailable("kvd has not answered since a lookup passed its deadline")
            c._ensure_connected()
            lookup.sent_under = c._hellos
            # never waits for the socket: a daemon that cannot take it now is a miss
            fields = {"lease_ms": lookup.lease_ms, "reg": lookup.reg.id}
            if lookup.part_tokens:
                fields["part_tokens"] = list(lookup.part_tokens)
            c._send_call(lookup, "lookup", fields, [wire.keys_frame(lookup.keys)], wait=0.0)
        except KvdError as exc:
            with c._lock:
                lookup.resolve(None, exc)

    def _send(self, t: Transfer) -> None:
        c = self.c
        fields = {"reg": t.reg.id, "deadline_us": int(t.deadline * 1e6)}
        if getattr(t, "after", None) is not None:
            fields["after"] = t.after
        if t.part_tokens:
            fields["part_tokens"] = t.part_tokens
        if getattr(t, "tenant", None) is not None and c.limits.get("tenant_labels"):
            fields["tenant"] = t.tenant  # a daemon before quotas refuses unknown fields
        if t.op == "load":
            fields.update(slot=t.slot, seq=t.seq, layerwise=t.layerwise)
            if getattr(t, "lease", None) is not None:
                fields["lease"] = t.lease
            if t.tail_pages and not t.part_tokens:
                fields["tail_pages"] = t.tail_pages
        with c._lock:  # registered before any thread can collect its reply
            req_id = c.channel.reserve_id()
            c._pending[req_id] = t
            t.sent_under = c._hellos
        try:  # a transfer never waits long to be sent: a daemon that cannot take it is a miss
            c.channel.send(t.op, fields, [wire.keys_frame(t.keys), t.pages],
                           wait=min(c.timeout, SEND_WAIT_S), req_id=req_id)
        except BaseException:
            with c._lock:
                ours = c._pending.pop(req_id, None) is not None
            if ours:
                raise
            return  # the keeper failed it meanwhile (the daemon died): it is finished once
        with c._lock:
            t.req_id, t.sent = req_id, True

    def _finish_unsent(self, t: Transfer, error: KvdError | None) -> None:
        """A transfer that never reached a daemon: nothing can touch its pages."""
        with self.c._lock:
            if error is None:
                t.succeed(0)
            else:
                t.fail(error)
            if t.seq is not None:
                t.reg.flags.release_waits(t.slot, t.seq)
            t.fence()
            self._finished(t)

    def free_slot(self, reg, deadline: float) -> int:
        """A load slot of ``reg`` whose last transfer is done, driving progress meanwhile."""
        while True:
            with self.c._lock:
                for slot, owner in enumerate(reg.owners):
                    if owner is None or owner.done:
                        return slot
            if time.monotonic() >= deadline:
                raise TooLarge(f"all {len(reg.owners)} load slots of this pool are in flight; "
                               "collect finished loads (poll) or raise load_slots")
            self.progress(None, min(0.01, deadline - time.monotonic()))

    # ---- receiving --------------------------------------------------------------------

    def progress(self, target=None, timeout: float | None = None) -> None:
        c = self.c
        with c._lock:
            self.waiters += 1
        try:
            wait = 0.01 if timeout is None else max(0.0, min(timeout, 0.01))
            replies = c.channel.collect(wait)
            with c._lock:
                for req_id, result, error in replies:
                    self._dispatch(req_id, result, error)
                self._housekeeping()
                strays, c._stray_leases = c._stray_leases, []
        finally:
            with c._lock:
                self.waiters -= 1
        for lease in strays:  # leases of lookups nobody reads
            c.release(lease, wait=False)
        if self.resend and c._hello_thread is None:
            self._recover()

    def _dispatch(self, req_id: int, result, error) -> None:
        self.c.lookups_unanswered = False  # the daemon answers again
        item = self.c._pending.pop(req_id, None)
        if item is None:
            return
        if not isinstance(item, Transfer):
            item.resolve(result, error)
            return
        if error is None:
            chunks = result["loaded"] if item.op == "load" else result["stored"] + result["deduped"]
            item.succeed(item.tokens_of(chunks))
            self._finished(item)
        elif isinstance(error, NoSession):  # the daemon restarted or reaped us: hello next
            self.session_lost(item.sent_under)
            if item.attempts < self.c.retry.attempts:
                item.attempts += 1
                self.resend.append(item)
            else:
                self._fail(item, error)
        else:
            self._fail(item, error)

    def _fail(self, t: Transfer, error: Exception) -> None:
        t.fail(error)
        if t.seq is None:  # a store: ended is fenced
            self._finished(t)
            return
        flags = t.reg.flags
        flags.cancel(t.slot, t.seq)       # kernels not started yet skip the pages
        flags.release_waits(t.slot, t.seq)  # no engine stream waits on a failed load
        if flags.done(t.slot, t.seq) or getattr(error, "code", None) in NOT_QUEUED:
            t.fence()
            self._finished(t)
        else:
            t.fence_at = time.monotonic() + self.c.fence_quiet_s
            self.fencing.append(t)

    def _finished(self, t: Transfer) -> None:
        if getattr(t, "collect", False):
            self.c._finished.append(t)

    # ---- housekeeping (the client's lock is held) ---------------------------------------

    def _housekeeping(self) -> None:
        c, now = self.c, time.monotonic()
        for req_id, item in list(c._pending.items()):
            if isinstance(item, Transfer) and now > item.deadline:
                del c._pending[req_id]
                c.channel.forget(req_id)
                self._fail(item, Timeout(f"kvd did not finish the {item.op} within "
                                         f"{c.timeout:g} s"))
            elif isinstance(item, Lookup) and now > item.forget_at:
                del c._pending[req_id]  # any lease it would still get expires by itself
                c.channel.forget(req_id)
                item.expire()
        for t in list(self.fencing):
            if t.reg.flags.done(t.slot, t.seq) or now >= t.fence_at:
                self.fencing.remove(t)
                t.fence()
                self._finished(t)
        busy = any(isinstance(i, (Transfer, Lookup)) for i in c._pending.values())
        if busy and c.connected and now - self.last_probe > PROBE_PERIOD_S:
            self.last_probe = now
            if c.probe.gone(c.limits.get("daemon_pid")):
                self._daemon_gone()

    def session_lost(self, sent_under: int) -> None:
        """A request sent under hello number ``sent_under`` was answered ``no_session``:
        hello again, unless a hello was answered since (the answer is about the session
        before it, and a needless hello would drop this one's registrations)."""
        with self.c._lock:
            if sent_under == self.c._hellos:
                self.c._need_hello = True

    def _daemon_gone(self) -> None:
        """The daemon's process ended: everything in flight failed; a load's pages are
        fenced after ``fence_quiet_s`` (time for the driver to tear its context down)."""
        c = self.c
        log.warning("kvd (pid %s) is gone; %d requests in flight failed",
                    c.limits.get("daemon_pid"), len(c._pending))
        c.connected, c._need_hello, c.lookups_unanswered = False, True, False
        for reg in c.registrations:
            reg.id = 0
        error = DaemonUnavailable("the daemon exited while the request was in flight")
        for req_id, item in list(c._pending.items()):
            del c._pending[req_id]
            c.channel.forget(req_id)
            if isinstance(item, Transfer):
                self._fail(item, error)
            else:
                item.resolve(None, error)

    def _recover(self) -> None:
        """Hello and register again, then resend what ``no_session`` turned away."""
        c = self.c
        with c._lock:
            todo, self.resend = self.resend, []
        try:
            time.sleep(c.retry.delay(min(t.attempts for t in todo) - 1))
            c._hello()
        except KvdError as exc:
            with c._lock:
                for t in todo:
                    self._fail(t, exc)
            return
        for t in todo:
            try:
                self._send(t)
            except KvdError as exc:
                with c._lock:
                    self._fail(t, exc)

    # ---- the background thread ---------------------------------------------------------

    def keep(self) -> None:
        c = self.c
        while not c._closed.wait(self._period()):
            try:
                if self.waiters == 0:
                    self.progress(None, 0.0)
                if c.connected and c._heartbeat and time.monotonic() - c._last_ok > self._interval():
                    self._heartbeat()
                elif not c.connected and c.registrations and c.channel.socket_exists():
                    c._hello()  # a daemon appeared: register the pools
            except KvdError as exc:
                log.debug("background exchange failed: %s", exc)
            except Exception:  # noqa: BLE001 - the engine must never lose this thread
                log.exception("kvd_client background thread")

    def _period(self) -> float:
        busy = bool(self.c._pending) or bool(self.fencing)
        return KEEPER_PERIOD_S if busy else min(self._interval(), 1.0)

    def _interval(self) -> float:
        return float(self.c.limits.get("heartbeat_interval_s", 5.0))

    def _heartbeat(self) -> None:
        c = self.c
        c._last_ok = time.monotonic()
        try:  # never waits for the socket: a dead daemon's would hold this thread, and with
            # it the liveness probe, for the whole wait (a live one takes it at once)
            c._call("heartbeat", {}, timeout=min(c.timeout, self._interval()), send_wait=0.0)
        except NoSession:  # _call decided whether a hello is due
            c._hello()
