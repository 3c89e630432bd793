"""The daemon's operations, one method per protocol op, over validated requests.

``handle(peer, request)`` runs an engine op and returns its result map or
raises a ``ServerError``; nothing is changed by a request that fails
validation. Store: dedup, reserve shards (all or nothing), gather, commit
when the copy completed; the reply means the engine's pages may be reused.
Load: pin the longest ready prefix (or the caller's lease), scatter,
unpin; the reply means the pages hold the bytes. Reaping a session waits
for its copies, then releases its leases and unmaps its pools.
With a disk tier (``tiering``), lookup continues the host prefix with keys
on disk (reported as ``disk_hits``, promotion started) and load promotes
them into host slots before scattering (kvd/tiers/tiering.py); for pools that GPU
Direct Storage serves (``gds``) lookup only counts them and load reads them
straight into the pages (kvd/cuda/gds.py). At debug level,
store and load log their time in the service and, of that, in the copy.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from kvd.copy.plan import CopyPlan
from kvd.server.sessions import Lease, Registration, Session, SessionTable
from kvd.server.stats import Stats
from kvd.tiers.host import HostTier
from kvd_protocol import wire
from kvd_protocol.errors import (
    BadRequest,
    CopyFailed,
    DeadlineExceeded,
    Forbidden,
    NoSession,
    NotFound,
    OutOfRange,
    ServerError,
    TooLarge,
    VersionMismatch,
)
from kvd_protocol.keys import namespace_digest

log = logging.getLogger("kvd")


class Service:
    def __init__(self, cfg, tier: HostTier, engines: dict):
        self.cfg = cfg
        self.tier = tier
        self.engines = engines  # buffer kind -> copy engine
        self.backends = ",".join(sorted({e.name for e in engines.values()}))
        self.sessions = SessionTable()
        self.stats = Stats()
        self.tiering = None  # kvd.tiers.tiering.Tiering when the disk tier is on (set by the server)
        self.gds = None  # kvd.cuda.gds.GdsLoader when disk_gds is on and available (set by the server)

    # ---- dispatch -------------------------------------------------------------

    async def handle(self, peer: bytes, req: wire.Request):
        if req.op == "hello":
            return await self.hello(peer, req.fields)
        session = self.sessions.by_peer.get(peer)
        if session is None or session.closing:
            raise NoSession("no session: send hello first")
        session.last_seen = time.monotonic()
        return await getattr(self, f"op_{req.op}")(session, req)

    # ---- session ops ----------------------------------------------------------

    async def hello(self, peer: bytes, f: dict):
        if not any(v == wire.VERSION and type(v) is int for v in f["versions"]):
            raise VersionMismatch(f"client speaks {f['versions']!r}, daemon speaks {wire.VERSION}")
        old = self.sessions.by_peer.get(peer)
        if old is not None:
            await self.reap(old, "re-hello")
        elif len(self.sessions) >= self.cfg.max_clients:
            raise TooLarge(f"too many clients (max_clients={self.cfg.max_clients})")
        self.sessions.by_peer[peer] = Session(peer, f["client"][:128], f["pid"])
        log.info("client %s (pid %d) connected", f["client"][:128], f["pid"])
        return {"version": wire.VERSION, "chunk_tokens": self.cfg.chunk_tokens,
                "max_message_bytes": self.cfg.max_message_bytes,
                "max_keys": self.cfg.max_keys_per_request,
                "heartbeat_interval_s": self.cfg.heartbeat_interval_s,
                "client_timeout_s": self.cfg.client_timeout_s,
                "lease_max_ms": self.cfg.lease_max_ms, "backend": self.backends}

    async def op_heartbeat(self, session: Session, req):
        return {}

    async def op_bye(self, session: Session, req):
        await self.reap(session, "bye")
        return {}

    async def op_register(self, session: Session, req):
        f = req.fields
        if len(session.registrations) >= self.cfg.max_registrations:
            raise TooLarge(f"too many registrations (max_registrations={self.cfg.max_registrations})")
        ns = wire.namespace_from_wire(f["namespace"], self.cfg.chunk_tokens)
        layout = wire.layout_from_wire(f["layout"])
        buffers = wire.buffers_from_wire(f["buffers"], 2 * layout.num_layers + 2)
        _check_layout_matches(ns, layout, f["tp_rank"])
        events = wire.events_from_wire(f.get("events", []), 256)
        engine = self._engine_for(buffers)
        pool = engine.open_pool(buffers, layout, events)
        shard = 0 if ns.attention == "mla" else f["tp_rank"]  # MLA: one copy for all ranks
        reg = Registration(self.sessions.next_id(), session, ns, namespace_digest(ns),
                           shard, layout, pool, engine)
        if self.gds is not None:
            self._prepare_gds(reg)
        session.registrations[reg.id] = reg
        self.sessions.registrations[reg.id] = reg
        return {"reg": reg.id, "shard_bytes": reg.shard_bytes, "namespace": reg.ns_digest,
                "pages_per_chunk": reg.pages_per_chunk,
                "load_events": getattr(pool, "load_event_handles", [])}

    def _prepare_gds(self, reg: Registration) -> None:
        try:
            self.gds.prepare(reg)
        except Exception as exc:  # noqa: BLE001 - GDS is an optimization: fall back, keep serving
            log.warning("GPU Direct Storage unavailable for this pool (%s: %s); its disk chunks "
                        "load through the host tier", type(exc).__name__, exc)

    def _direct(self, reg: Registration) -> bool:
        """Whether this pool's disk-only chunks load by GPU Direct Storage."""
        return self.gds is not None and self.gds.eligible(reg)

    def _engine_for(self, buffers: list):
        kinds = {b["kind"] for b in buffers}
        engine = self.engines.get(kinds.pop()) if len(kinds) == 1 else None
        if engine is None:
            raise BadRequest(f"buffers of kind {sorted({b['kind'] for b in buffers})} are not served "
                             f"here (backends: {self.backends})")
        return engine

    async def op_unregister(self, session: Session, req):
        reg = self._registration(session, req.fields["reg"])
        await self._close_registration(reg)
        return {}

    def _registration(self, session: Session, reg_id: int) -> Registration:
        reg = self.sessions.registrations.get(reg_id)
        if reg is None or reg.closing:
            raise NotFound(f"no registration {reg_id}")
        if reg.session is not session:
            raise Forbidden(f"registration {reg_id} belongs to another client")
        return reg

    async def _close_registration(self, reg: Registration) -> None:
        reg.closing = True
        await reg.drain()
        reg.session.registrations.pop(reg.id, None)
        self.sessions.registrations.pop(reg.id, None)
        reg.engine.close_pool(reg.pool)

    async def reap(self, session: Session, why: str) -> None:
        """Finish the session's copies, then drop its leases and pools."""
        if session.closing:
            return
        session.closing = True
        for lease in list(session.leases.values()):
            self._drop_lease(lease)
        for reg in list(session.registrations.values()):
            await self._close_registration(reg)
        if self.sessions.by_peer.get(session.peer) is session:
            del self.sessions.by_peer[session.peer]
        if why != "bye":
            self.stats.add("clients_reaped")
        log.info("client %s (pid %d) removed: %s", session.name, session.pid, why)

    # ---- leases ---------------------------------------------------------------

    def _drop_lease(self, lease: Lease) -> None:
        if self.sessions.leases.pop(lease.id, None) is not None:
            lease.session.leases.pop(lease.id, None)
            self.tier.unpin(lease.entries)

    async def op_release(self, session: Session, req):
        lease = self._lease(session, req.fields["lease"])
        self._drop_lease(lease)
        return {}

    def _lease(self, session: Session, lease_id: int) -> Lease:
        lease = self.sessions.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"no lease {lease_id} (expired or released)")
        if lease.session is not session:
            raise Forbidden(f"lease {lease_id} belongs to another client")
        return lease

    def expire(self, now: float) -> None:
        for lease in self.sessions.expired_leases(now):
            self._drop_lease(lease)

    # ---- data ops -------------------------------------------------------------

    def _keys_and_pages(self, reg: Registration, req):
        keys = wire.keys_from_frame(req.frames[0], self.cfg.max_keys_per_request)
        pages = wire.pages_from_frame(req.frames[1])
        if len(pages) != len(keys) * reg.pages_per_chunk:
            raise BadRequest(f"{len(keys)} chunks need {len(keys) * reg.pages_per_chunk} page ids, "
                             f"got {len(pages)}")
        if len(pages) and (pages.min() < 0 or pages.max() >= reg.layout.num_pages):
            raise OutOfRange(f"page ids must lie in [0, {reg.layout.num_pages})")
        return keys, pages

    async def op_lookup(self, session: Session, req):
        reg = self._registration(session, req.fields["reg"])  # a lease belongs to the session
        keys = wire.keys_from_frame(req.frames[0], self.cfg.max_keys_per_request)
        hits = self.tier.ready_prefix(keys)
        for entry in hits:
            entry.hits += 1
        disk_hits = 0  # continue the prefix on disk; those start promoting to host
        if self.tiering is not None and len(hits) < len(keys):
            disk_hits = self.tiering.disk_prefix(keys[len(hits):], promote=not self._direct(reg))
        self.stats.add("hit_chunks", len(hits) + disk_hits)
        self.stats.add("disk_hit_chunks", disk_hits)
        self.stats.add("miss_chunks", len(keys) - len(hits) - disk_hits)
        extra = {} if self.tiering is None else {"disk_hits": disk_hits}
        lease_ms = min(req.fields.get("lease_ms", 0), self.cfg.lease_max_ms)
        if not hits or lease_ms == 0:  # a lease pins host hits; disk hits are best effort
            return {"hits": len(hits) + disk_hits, "lease": None, **extra}
        lease = Lease(self.sessions.next_id(), session, hits, time.monotonic() + lease_ms / 1e3)
        self.tier.pin(hits)
        session.leases[lease.id] = lease
        self.sessions.leases[lease.id] = lease
        return {"hits": len(hits) + disk_hits, "lease": lease.id, **extra}

    async def op_store(self, session: Session, req):
        t0 = time.perf_counter()
        reg = self._registration(session, req.fields["reg"])
        keys, pages = self._keys_and_pages(reg, req)
        todo, deduped = self._reserve(reg, keys)
        self.stats.add("store_dedup", deduped)
        if todo:
            chunks = [i for i, _ in todo]
            plan = CopyPlan(reg.pool, reg.layout, reg.ns.chunk_tokens,
                            pages.reshape(len(keys), -1)[chunks].reshape(-1),
                            [e.shard_offset(reg.tp_rank) for _, e in todo],
                            wait_event=req.fields.get("event"))
            try:
                waited = await self._copy(reg, lambda: reg.engine.gather(plan))
                _check_deadline(req.fields.get("deadline_us"))
            except BaseException:
                for _, entry in todo:
                    self.tier.abort(entry, reg.tp_rank)
                raise
            for _, entry in todo:
                self.tier.commit(entry, reg.tp_rank)
            if self.tiering is not None:
                self.tiering.wake.set()  # the demoter looks at the watermark now
            _log_timing("store", len(todo), t0, waited)
        self.stats.add("chunks_stored", len(todo))
        self.stats.add("bytes_stored", len(todo) * reg.shard_bytes)
        return {"stored": len(todo), "deduped": deduped}

    def _reserve(self, reg: Registration, keys: list):
        """Reserve every shard to copy, all or nothing (kvd.tiers.host.HostTier.reserve_many)."""
        return self.tier.reserve_many(keys, reg.ns_digest, reg.shard_bytes, reg.ns.shards,
                                      reg.tp_rank)

    async def op_load(self, session: Session, req):
        t0 = time.perf_counter()
        reg = self._registration(session, req.fields["reg"])
        keys, pages = self._keys_and_pages(reg, req)
        lease = self._lease(session, req.fields["lease"]) if "lease" in req.fields else None
        entries = self.tier.ready_prefix(keys)
        self.tier.pin(entries)
        host_pages = pages[:len(entries) * reg.pages_per_chunk]
        direct = 0  # chunks read from disk straight into the pages (kvd.cuda.gds), queued first
        if self.tiering is not None and len(entries) < len(keys):  # the rest of the prefix on disk
            try:
                direct, promoted, promoted_pages = await self._from_disk(reg, req, keys, pages,
                                                                         len(entries))
            except BaseException:
                self.tier.unpin(entries)
                raise
            entries += promoted
            host_pages = np.concatenate([host_pages, promoted_pages])
            if reg.closing:  # unregistered or reaped while disk reads ran: its pool is gone
                self.tier.unpin(entries)
                raise NotFound(f"registration {reg.id} was closed during the load")
        result = {"loaded": len(entries) + direct}

        def finish(_=None):
            self.tier.unpin(entries)
            if lease is not None:
                self._drop_lease(lease)

        if not entries and not direct:
            finish()
            return result
        try:
            _check_deadline(req.fields.get("deadline_us"))  # the client gave up: leave its pages alone
        except DeadlineExceeded:
            finish()
            raise
        layerwise = bool(req.fields.get("layerwise")) and reg.engine.name == "cuda"
        plan = CopyPlan(reg.pool, reg.layout, reg.ns.chunk_tokens, host_pages,
                        [e.shard_offset(reg.tp_rank) for e in entries], layerwise=layerwise)
        if layerwise:
            # reply once the copies are queued: the engine waits on per-layer events
            future = self._start_copy(reg, lambda: reg.engine.scatter(plan))
            future.add_done_callback(finish)
            result["slot"] = plan.event_slot
        else:
            try:
                waited = await self._copy(reg, lambda: reg.engine.scatter(plan))
            finally:
                finish()
            _log_timing("load", len(entries), t0, waited)
        self.stats.add("chunks_loaded", len(entries) + direct)
        self.stats.add("bytes_loaded", (len(entries) + direct) * reg.shard_bytes)
        return result

    async def _from_disk(self, reg: Registration, req, keys: list, pages, hits: int):
        """The prefix past the first ``hits`` chunks, from disk: (chunks GPU Direct Storage
        queued, host entries promoted from disk (pinned), their page ids). GDS comes first;
        where it failed for IO reasons (not a bad chunk) the rest takes the host path."""
        ppc, direct = reg.pages_per_chunk, 0
        if self._direct(reg):
            direct, fallback = await self.gds.load(
                reg, keys[hits:], pages[hits * ppc:], self.tier,
                lambda: _check_deadline(req.fields.get("deadline_us")))
            if not fallback:
                return direct, [], pages[:0]
        promoted = await self.tiering.promote_prefix(keys[hits + direct:])
        first = (hits + direct) * ppc
        return direct, promoted, pages[first:first + len(promoted) * ppc]

    def _start_copy(self, reg: Registration, start) -> asyncio.Future:
        """Start a copy and track it on the registration until it completes."""
        try:
            future = asyncio.ensure_future(start())
        except ServerError:
            raise
        except Exception as exc:
            log.exception("copy could not start")
            raise CopyFailed(f"copy could not start: {type(exc).__name__}: {exc}") from None
        reg.inflight.add(future)
        future.add_done_callback(reg.inflight.discard)
        future.add_done_callback(_log_failure)
        return future

    async def _copy(self, reg: Registration, start) -> float:
        """Run a copy to completion; returns the seconds spent waiting for it."""
        t0 = time.perf_counter()
        future = self._start_copy(reg, start)
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.gather(future, return_exceptions=True)  # never leave a copy running unowned
            raise
        except Exception as exc:
            raise CopyFailed(f"copy failed: {type(exc).__name__}: {exc}") from None
        return time.perf_counter() - t0


def _check_deadline(deadline_us) -> None:
    """Past the client's deadline: it stopped waiting and may reuse its pages, so a
    finished store cannot be trusted and a load must not start."""
    if deadline_us is not None and time.monotonic_ns() // 1000 > deadline_us:
        raise DeadlineExceeded("the store finished after the client's deadline; nothing kept")


def _log_timing(op: str, chunks: int, t0: float, waited: float) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s of %d chunks: %.3f ms in the service, %.3f ms of it in the copy", op, chunks,
                  (time.perf_counter() - t0) * 1e3, waited * 1e3)


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("copy failed: %r", future.exception())


def _check_layout_matches(ns, layout, tp_rank: int) -> None:
    if layout.num_layers != ns.num_layers or layout.planes != ns.planes:
        raise BadRequest(f"layout has {layout.num_layers} layers x {layout.planes} planes, the "
                         f"namespace says {ns.num_layers} x {ns.planes}")
    if layout.row_bytes != ns.row_bytes:
        raise BadRequest(f"layout rows are {layout.row_bytes} bytes, the namespace needs {ns.row_bytes}")
    if ns.chunk_tokens % layout.page_size:
        raise BadRequest(f"chunk_tokens {ns.chunk_tokens} is not a multiple of page_size {layout.page_size}")
    if tp_rank >= ns.tp_size:
        raise BadRequest(f"tp_rank {tp_rank} must be < tp_size {ns.tp_size}")
