"""The daemon's operations, one method per protocol op, over validated requests.

``handle(peer, request)`` runs an engine op and returns its result map or raises a
``ServerError``; a request that fails validation changes nothing. Per session at most
``max_inflight`` data requests (more: ``busy``). Store and load move bytes through
kvd.server.transfers; closing a registration waits (bounded) for its copies before
unmapping. Lookups and loads see only the registration's scope (kvd.tiers.scope); a lookup
continues on disk and in the remote store (bounded by ``remote_timeout_s``). A store whose
``tenant`` a quota rule binds gets ``forbidden`` unless the connection's credentials match
(kvd.server.tenants). Every line a peer causes goes through ``peer_log``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from kvd.copy.flags import FlagPage
from kvd.printable import printable
from kvd.server import leftovers, logs
from kvd.server.fd_intake import close_fds
from kvd.server.sessions import Lease, Registration, Session, SessionTable
from kvd.server.stats import Stats
from kvd.server.tenants import TenantBindings
from kvd.server.transfers import Transfers
from kvd.tiers.host.tier import HostTier
from kvd_protocol import wire
from kvd_protocol.errors import (
    BadRequest,
    Busy,
    Forbidden,
    NoSession,
    NotFound,
    TooLarge,
    VersionMismatch,
)
from kvd_protocol.keys import namespace_digest

log = logging.getLogger("kvd")
DATA_OPS = ("lookup", "store", "load")
PEER_LINES = 4  # log lines one peer (uid, pid) may cause per 10 s; the rest are summarized


class Service:
    def __init__(self, cfg, tier: HostTier, engines: dict, arena_id: tuple[int, int] | None = None,
                 instance: str = ""):
        self.cfg = cfg
        self.tier = tier
        self.engines = engines  # buffer kind -> copy engine
        self.fd_intake = None  # kvd.server.fd_intake.FdIntake: with the CUDA backend
        self.backends = ",".join(sorted({e.name for e in engines.values()}))
        self.sessions = SessionTable()
        self.stats = Stats()
        self.transfers = Transfers(cfg, tier, self.stats)
        self.shm_dir = Path(cfg.shm_dir).resolve()
        self.arena_id = arena_id  # (st_dev, st_ino) of the arena: never a client's file
        self.instance = instance  # this daemon's random id: a restart changes it
        # every line a peer makes us write (hello, bye, malformed, refused): a few per (uid, pid)
        self.peer_log = logs.PeerLimiter(burst=PEER_LINES)
        self.tenants = TenantBindings(cfg.quota)  # labels bound to credentials (quota rules)

    @property
    def tiering(self):
        return self.transfers.tiering

    @tiering.setter
    def tiering(self, value) -> None:
        self.transfers.tiering = value

    @property
    def remote(self):
        return self.transfers.remote

    @remote.setter
    def remote(self, value) -> None:
        self.transfers.remote = value

    @property
    def gds(self):
        return self.transfers.gds

    @gds.setter
    def gds(self, value) -> None:
        self.transfers.gds = value

    # ---- dispatch -------------------------------------------------------------

    async def handle(self, peer: bytes, req: wire.Request, cred=None):
        if req.op == "hello":
            return await self.hello(peer, req.fields, cred)
        session = self.sessions.by_peer.get(peer)
        if session is None or session.closing:
            raise NoSession("no session: send hello first")
        if cred != session.cred:  # its routing id, taken over by another process
            raise Forbidden("this session belongs to another process")
        if req.op == "store" and self.tenants:
            self.tenants.check(req.fields.get("tenant"), cred)
        if req.op in DATA_OPS and session.inflight >= self.cfg.max_inflight:
            self.stats.add("busy")
            raise Busy(f"{session.inflight} requests of this client are in flight already "
                       f"(max_inflight={self.cfg.max_inflight}); nothing done")
        session.inflight += 1
        session.last_seen = time.monotonic()
        try:
            return await getattr(self, f"op_{req.op}")(session, req)
        finally:
            session.inflight -= 1
            session.last_seen = time.monotonic()

    # ---- session ops ----------------------------------------------------------

    async def hello(self, peer: bytes, f: dict, cred=None):
        if not any(v == wire.VERSION and type(v) is int for v in f["versions"]):
            raise VersionMismatch(f"client speaks protocol {wire.describe(f['versions'])}, this "
                                  f"daemon speaks {wire.VERSION}: install the kvd_client of this "
                                  "daemon's release")
        old = self.sessions.by_peer.get(peer)
        if old is None and len(self.sessions) >= self.cfg.max_clients:
            raise TooLarge(f"too many clients (max_clients={self.cfg.max_clients})")
        # The new session takes the routing id before the old one is reaped (which waits for
        # its copies): requests sent after this hello meanwhile belong to the new one, and a
        # hello racing this one replaces it in turn. Never two live sessions for one id.
        name = printable(f["client"])  # shown in the log, kvd stats and kvd top
        self.sessions.by_peer[peer] = Session(peer, name, f["pid"], cred)
        self.peer_log.log(log, logging.INFO, logs.peer_key(peer, cred),
                          "client %s (pid %d) connected%s", name, f["pid"], "" if cred is None else
                          f": uid {cred.uid} gid {cred.gid} pid {cred.pid} (kernel)")
        if old is not None:
            await self.reap(old, "re-hello")
        return {"version": wire.VERSION, "chunk_tokens": self.cfg.chunk_tokens,
                "max_message_bytes": self.cfg.max_message_bytes,
                "max_keys": self.cfg.max_keys_per_request,
                "max_inflight": self.cfg.max_inflight,
                "heartbeat_interval_s": self.cfg.heartbeat_interval_s,
                "client_timeout_s": self.cfg.client_timeout_s,
                "lease_max_ms": self.cfg.lease_max_ms, "backend": self.backends, "partial_chunks": True,
                "daemon_pid": os.getpid(), "instance": self.instance, "tenant_labels": True}

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
        buffers, lent = self._with_fds(session, wire.buffers_from_wire(f["buffers"],
                                                                      2 * layout.num_layers + 2))
        try:  # lent file descriptors are closed whatever happens: a mapping keeps its own
            _check_layout_matches(ns, layout, f["tp_rank"])
            flags_spec, flag_layout = wire.flags_from_wire(f["flags"], layout.num_layers)
            engine = self._engine_for(buffers)
            owner = getattr(session.cred, "uid", None)  # files must be the registering process's
            flags = FlagPage.open(flags_spec, flag_layout, self.shm_dir, self.arena_id, owner)
            try:
                pool = engine.open_pool(buffers, layout, flags, owner)
            except BaseException:
                flags.close()
                raise
        finally:
            close_fds(lent)
        shard = 0 if ns.attention == "mla" else f["tp_rank"]  # MLA: one copy for all ranks
        reg = Registration(self.sessions.next_id(), session, ns, namespace_digest(ns),
                           shard, layout, pool, engine, flags,
                           leftovers.identify([flags_spec["path"]] + [b["path"] for b in buffers
                                                                      if b["kind"] == "shm"]))
        if self.gds is not None:
            self._prepare_gds(reg)
        self._adopt(session, reg)
        return {"reg": reg.id, "shard_bytes": reg.shard_bytes, "namespace": reg.ns_digest,
                "pages_per_chunk": reg.pages_per_chunk}

    async def op_attach(self, session: Session, req):
        """A registration of a namespace without a pool: lookups (and leases) only."""
        f = req.fields
        if len(session.registrations) >= self.cfg.max_registrations:
            raise TooLarge(f"too many registrations (max_registrations={self.cfg.max_registrations})")
        ns = wire.namespace_from_wire(f["namespace"], self.cfg.chunk_tokens)
        if f["tp_rank"] >= ns.tp_size:
            raise BadRequest(f"tp_rank {f['tp_rank']} must be < tp_size {ns.tp_size}")
        reg = Registration(self.sessions.next_id(), session, ns, namespace_digest(ns),
                           0 if ns.attention == "mla" else f["tp_rank"], None, None, None, None)
        self._adopt(session, reg)
        return {"reg": reg.id, "namespace": reg.ns_digest}

    def _adopt(self, session: Session, reg: Registration) -> None:
        """Give ``reg`` to ``session``, unless the session is being reaped (replaced by a new
        hello, bye, silence): reaping closed the registrations it had, and one added now
        would stay mapped with no session to close it."""
        if session.closing:
            _close_now(reg)
            raise NoSession("the session ended while the pool was registered: send hello first")
        session.registrations[reg.id] = reg
        self.sessions.registrations[reg.id] = reg

    def _prepare_gds(self, reg: Registration) -> None:
        try:
            self.gds.prepare(reg)
        except Exception as exc:  # noqa: BLE001 - GDS is an optimization: fall back, keep serving
            log.warning("GPU Direct Storage unavailable for this pool (%s: %s); its disk chunks "
                        "load through the host tier", type(exc).__name__, exc)

    def _with_fds(self, session: Session, buffers: list) -> tuple[list, list]:
        """``cuda_vmm`` buffers with their pieces' file descriptors (``fds``), taken from
        fds.sock by the token (kvd.server.fd_intake), and every descriptor taken."""
        tokens = {b["token"] for b in buffers if b["kind"] == "cuda_vmm"}
        if not tokens:
            return buffers, []
        if self.fd_intake is None:
            raise BadRequest("this daemon maps no virtual-memory pools (no CUDA backend, or its "
                             "GPUs cannot import file descriptors)")
        if len(tokens) != 1:
            raise BadRequest("the cuda_vmm buffers of one registration share one token")
        fds = self.fd_intake.take(tokens.pop(), session.cred)
        need = sum(len(b.get("pieces", ())) for b in buffers)
        if len(fds) != need:
            close_fds(fds)
            raise BadRequest(f"{len(fds)} file descriptors lent for {need} pieces")
        out, at = [], 0
        for b in buffers:
            n = len(b.get("pieces", ()))
            out.append({**b, "fds": fds[at:at + n]} if n else b)
            at += n
        return out, fds

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

    def _with_pool(self, session: Session, reg_id: int) -> Registration:
        reg = self._registration(session, reg_id)
        if reg.pool is None:
            raise BadRequest(f"registration {reg_id} was attached for lookups: it has no KV pool")
        return reg

    def _registration(self, session: Session, reg_id: int) -> Registration:
        reg = self.sessions.registrations.get(reg_id)
        if reg is None or reg.closing:
            raise NotFound(f"no registration {reg_id}")
        if reg.session is not session:
            raise Forbidden(f"registration {reg_id} belongs to another client")
        return reg

    async def _close_registration(self, reg: Registration) -> None:
        if reg.closing:
            return
        reg.closing = True
        for waiter in list(reg.waiting):  # requests waiting on the client end now
            waiter.cancel()
        async with reg.turn:  # the request queueing copies now finishes queueing them
            await reg.drain()
        await reg.unused()  # also the requests behind it, and those past their copy
        reg.session.registrations.pop(reg.id, None)
        self.sessions.registrations.pop(reg.id, None)
        _close_now(reg)

    async def reap(self, session: Session, why: str) -> None:
        """Finish the session's copies, then drop its leases and pools."""
        if session.closing:
            return
        session.closing = True
        t0 = time.monotonic()
        for lease in list(session.leases.values()):
            self._drop_lease(lease)
        files = [f for reg in session.registrations.values() for f in reg.files]
        for reg in list(session.registrations.values()):
            await self._close_registration(reg)
        if why != "bye" and files:  # a client lost: the files it could not remove
            self.stats.add("client_files_removed", leftovers.remove_abandoned(files))
        if self.sessions.by_peer.get(session.peer) is session:
            del self.sessions.by_peer[session.peer]
        if why != "bye":
            self.stats.add("clients_reaped")
        self.peer_log.log(log, logging.INFO, logs.peer_key(session.peer, session.cred),
                          "client %s (pid %d) removed: %s (%.3f s)", session.name, session.pid,
                          why, time.monotonic() - t0)

    def stop_waiting(self) -> None:
        """Shutdown: every request waiting on a client ends now (``shutting_down``)."""
        self.transfers.stopping = True
        for reg in list(self.sessions.registrations.values()):
            for waiter in list(reg.waiting):
                waiter.cancel()

    def abandon_copies(self) -> int:
        """Shutdown past its grace: stop waiting for copies still queued (a GPU that does not
        finish them), so their requests end now; the backends' ``close`` bounds the rest.
        Returns how many copies were abandoned."""
        abandoned = 0
        for reg in list(self.sessions.registrations.values()):
            for landed in list(reg.inflight):
                abandoned += landed.cancel()
        return abandoned

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

    async def op_lookup(self, session: Session, req):
        reg = self._registration(session, req.fields["reg"])  # a lease belongs to the session
        keys, parts = reg.lookup_keys(req, self.cfg.max_keys_per_request)  # chain, partial keys
        scope = reg.scope()  # another namespace's chunk is a miss on every tier
        hits = self.tier.ready_prefix(keys, scope)
        for entry in hits:
            entry.hits += 1
        disk_hits = 0  # continue the prefix on disk; those start promoting to host
        if self.tiering is not None and len(hits) < len(keys):
            direct = self.gds is not None and reg.pool is not None and self.gds.eligible(reg)
            disk_hits = self.tiering.disk_prefix(keys[len(hits):], scope, promote=not direct)
        remote_hits = 0  # then in the remote store; those start fetching into host
        if self.remote is not None and len(hits) + disk_hits < len(keys):
            remote_hits = await self.remote.lookup(scope, keys[len(hits) + disk_hits:])
        found = len(hits) + disk_hits + remote_hits
        self.stats.add("foreign_ns_misses", scope.refused > 0)
        self.stats.add("hit_chunks", found)
        self.stats.add("disk_hit_chunks", disk_hits)
        self.stats.add("remote_hit_chunks", remote_hits)
        self.stats.add("miss_chunks", len(keys) - found)
        extra = {} if self.tiering is None else {"disk_hits": disk_hits}
        if self.remote is not None:
            extra["remote_hits"] = remote_hits
        extra.update(reg.part_hit(self.tier, parts, hits, found == len(keys)))  # pins with hits
        lease_ms = min(req.fields.get("lease_ms", 0), self.cfg.lease_max_ms)
        # a lease pins host hits (other hits are best effort); a session reaped while the
        # remote store answered must not keep new pins
        if not hits or lease_ms == 0 or session.closing:
            return {"hits": found, "lease": None, **extra}
        lease = Lease(self.sessions.next_id(), session, hits, time.monotonic() + lease_ms / 1e3)
        self.tier.pin(hits)
        session.leases[lease.id] = lease
        self.sessions.leases[lease.id] = lease
        return {"hits": found, "lease": lease.id, **extra}

    async def op_store(self, session: Session, req):
        reg = self._with_pool(session, req.fields["reg"])
        with reg.used():  # no await since the check: closing waits for this store
            return await self.transfers.store(reg, req)

    async def op_load(self, session: Session, req):
        reg = self._with_pool(session, req.fields["reg"])
        lease = self._lease(session, req.fields["lease"]) if "lease" in req.fields else None
        try:
            with reg.used():  # its flag page stays open until the load read its cancel word
                return await self.transfers.load(reg, req)
        finally:
            if lease is not None:
                self._drop_lease(lease)


def _close_now(reg: Registration) -> None:
    """Unmap a registration's pool and flag page (nothing may use them any more)."""
    if reg.pool is not None:
        reg.engine.close_pool(reg.pool)
        reg.flags.close()


def _check_layout_matches(ns, layout, tp_rank: int) -> None:
    if layout.num_layers != ns.num_layers or layout.planes != ns.planes:
        raise BadRequest(f"layout has {layout.num_layers} layers x {layout.planes} planes, the "
                         f"namespace says {ns.num_layers} x {ns.planes}")
    if layout.row_bytes != ns.row_bytes:
        raise BadRequest(f"layout rows are {layout.row_bytes} bytes, the namespace needs {ns.row_bytes}")
    if ns.kv_heads % layout.heads:  # a row's pieces are whole heads, or the bytes mix heads
        raise BadRequest(f"layout rows come in {layout.heads} pieces, which must be whole heads "
                         f"of the namespace's {ns.kv_heads}")
    if ns.chunk_tokens % layout.page_size:
        raise BadRequest(f"chunk_tokens {ns.chunk_tokens} is not a multiple of page_size {layout.page_size}")
    if tp_rank >= ns.tp_size:
        raise BadRequest(f"tp_rank {tp_rank} must be < tp_size {ns.tp_size}")
