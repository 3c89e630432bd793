"""Store and load: the two ops that move chunk bytes, with their order and their fences.

Set-up runs inside the registration's ``turn`` (copies queue in arrival order); the wait
for the copy runs outside it. Store: reserve shards (dedup, all or nothing, quota), wait on
the host for the engine's stream to reach the store's ``seq``, queue the gather, commit
only if it landed before the client's deadline. Load: pin the longest ready prefix of the
registration's scope (host, verified if asked; disk promotions or GDS; remote fetches via
kvd.server.remote_load), then queue the scatter with the load's signal; ``tail_pages`` cut
the last chunk to its first pages. ``part_tokens``: one partial entry (host tier only).
Never lets an engine stream wait forever: on failure before the scatter, the slot's words
are released; never writes into the pages after the done word. Flow: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from kvd.copy.flags import LoadSignal
from kvd.copy.plan import SKIP_PAGE, CopyPlan
from kvd.copy.poll import EventPoller
from kvd.server.copy_gate import CopyGate
from kvd.server.remote_load import Pieces, queue_pieces
from kvd.server.sessions import Registration
from kvd_protocol import wire
from kvd_protocol.errors import (
    BadRequest,
    Cancelled,
    CopyFailed,
    DeadlineExceeded,
    NotFound,
    OutOfRange,
    ServerError,
    ShuttingDown,
)

log = logging.getLogger("kvd")


class Transfers:
    def __init__(self, cfg, tier, stats):
        self.cfg = cfg
        self.tier = tier
        self.stats = stats
        self.tiering = None  # kvd.tiers.disk.tiering.Tiering when the disk tier is on
        self.gds = None      # kvd.cuda.gds.GdsLoader when disk_gds is on and available
        self.remote = None   # kvd.tiers.remote.tiering.RemoteTiering when remote_backend is set
        self.verifier = None  # kvd.server.load_verify.LoadVerifier when verify_loads is on
        self.stopping = False
        # a store may wait a whole forward pass for the engine: poll gently when idle
        self.flag_poller = EventPoller(idle_after_s=0.001, idle_sleep_s=0.0002)
        self.gate = CopyGate(cfg.max_queued_copies, cfg.max_queued_copies_alone,
                             cfg.max_queued_bytes_alone)

    # ---- store ------------------------------------------------------------------

    async def store(self, reg: Registration, req: wire.Request) -> dict:
        t0 = time.perf_counter()
        keys, pages = self._keys_and_pages(reg, req)
        shard_bytes = reg.layout.shard_bytes(tokens := (part := _part(reg, req)) or reg.ns.chunk_tokens)
        deadline = req.fields.get("deadline_us")
        stamps: dict = {}
        async with reg.turn:
            stamps["turn"] = time.perf_counter()
            _check_open(reg)
            todo, deduped = self._reserve(reg, keys, req.fields.get("tenant"), shard_bytes, part)
            self.stats.add("store_dedup", deduped)
            if not todo:
                return {"stored": 0, "deduped": deduped}
            try:
                if "after" in req.fields:
                    await self._engine_reached(reg, req.fields["after"], deadline)
                stamps["mark"] = time.perf_counter()
                chunks = [i for i, _ in todo]
                plan = CopyPlan(reg.pool, reg.layout, tokens,
                                pages.reshape(len(keys), -1)[chunks].reshape(-1),
                                [e.shard_offset(reg.tp_rank) for _, e in todo])
                landed = await self._start(reg, reg.engine.gather(plan), "store",
                                           len(todo) * shard_bytes, stamps)
            except BaseException:
                self._abort(reg, todo)
                raise
        try:
            waited = await _landed(landed)
            _check_deadline(deadline)
        except BaseException:
            self._abort(reg, todo)
            raise
        self.tier.commit_many([e for _, e in todo], reg.tp_rank)
        if self.remote is not None:  # queued for the remote store, after the reply's path
            self.remote.stored([e for _, e in todo])
        if self.tiering is not None:
            self.tiering.wake.set()  # the demoter looks at the watermark now
        self._timing("store", len(todo), t0, waited, stamps)
        self.stats.copied("stored", reg.engine.name, len(todo), len(todo) * shard_bytes)
        return {"stored": len(todo), "deduped": deduped}

    async def _engine_reached(self, reg: Registration, mark: int, deadline_us) -> None:
        """Wait (polling the flag page from the loop) until the engine's stream wrote its
        ``mark``: the forward pass wrote a store's KV, or the kernels that last used a
        load's pages are done with them."""
        waiter = self.flag_poller.wait(reg.flags.engine_reached(mark))
        reg.waiting.add(waiter)
        timeout = None if deadline_us is None else max(0.0, deadline_us / 1e6 - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except asyncio.TimeoutError:
            raise DeadlineExceeded("the engine's stream did not reach the request's mark before "
                                   "the deadline; nothing copied") from None
        except asyncio.CancelledError:
            if not waiter.cancelled():
                raise  # the request itself was cancelled
            if self.stopping:
                raise ShuttingDown("daemon is shutting down; nothing stored") from None
            raise Cancelled("the registration closed while the request waited for the engine; "
                            "nothing copied") from None
        finally:
            reg.waiting.discard(waiter)
            waiter.cancel()

    def _timing(self, op: str, chunks: int, t0: float, waited: float, stamps: dict) -> None:
        """Its phases into the stats (``Stats.phases``); in the debug log, the service's time,
        the copy's, and when (ms after the request reached the service) the request got its
        registration's turn, the engine's mark, the copy gate, and had its copy queued."""
        end = time.perf_counter()
        self.stats.phases(op, t0, stamps, end)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s of %d chunks: %.3f ms in the service, %.3f ms of it in the copy; %s", op,
                      chunks, (end - t0) * 1e3, waited * 1e3,
                      ", ".join(f"{k} +{(v - t0) * 1e3:.3f}" for k, v in stamps.items()))

    def _reserve(self, reg: Registration, keys: list, tenant: str | None, shard_bytes: int,
                 part: int):
        """Reserve every shard to copy, all or nothing (kvd.tiers.host.tier.HostTier.reserve_many),
        new chunks in the quota account of the registration's model and ``tenant``."""
        quota = self.tier.quota
        acct = 0 if quota is None else quota.account(reg.ns.model, tenant)
        return self.tier.reserve_many(keys, reg.ns_digest, shard_bytes, reg.ns.shards,
                                      reg.tp_rank, acct, part)

    def _abort(self, reg: Registration, todo: list) -> None:
        for _, entry in todo:
            self.tier.abort(entry, reg.tp_rank)

    # ---- load -------------------------------------------------------------------

    async def load(self, reg: Registration, req: wire.Request) -> dict:
        t0 = time.perf_counter()
        keys, pages = self._keys_and_pages(reg, req)
        f = req.fields
        reg.flags.check_slot(f["slot"])
        signal = LoadSignal(reg.flags, f["slot"], f["seq"], bool(f.get("layerwise")))
        part = _part(reg, req)
        entries, direct, stamps, scope = [], 0, {}, reg.scope(part)
        pieces = Pieces()
        try:
            async with reg.turn:
                stamps["turn"] = time.perf_counter()
                try:
                    _check_open(reg)
                    if "after" in f:  # the pages' last users on the engine's stream are done
                        await self._engine_reached(reg, f["after"], f.get("deadline_us"))
                    stamps["mark"] = time.perf_counter()
                    entries, direct, host_pages, fetches = await self._pin_prefix(
                        reg, req, keys, pages, signal, scope)
                    _check_open(reg)  # reaped during the disk reads: its pool goes next
                    if fetches:  # remote hits: each run's copy queued as its fetches land
                        self._check_start(req, signal, direct)
                        await queue_pieces(self, reg, pages, keys, entries, direct, host_pages,
                                           fetches, signal, stamps, pieces, scope)
                    else:
                        one = await self._queue_scatter(reg, req, entries, direct, host_pages,
                                                        signal, stamps, part)
                        pieces.landed += [] if one is None else [one]
                except BaseException:
                    if not pieces.signalled:
                        await self._release_unqueued(reg, signal, direct, pieces.landed)
                    raise
            if not pieces.landed:
                return {"loaded": 0}
            waited = await _landed_all(pieces.landed)
        finally:
            self.tier.unpin(entries)
            self.stats.add("foreign_ns_misses", scope.refused > 0)
        if signal.cancelled:
            raise Cancelled("the client cancelled the load; its pages hold undefined bytes")
        self._timing("load", len(entries), t0, waited, stamps)
        loaded = len(entries) + direct
        self.stats.copied("loaded", reg.engine.name, loaded,
                          loaded * reg.layout.shard_bytes(part or reg.ns.chunk_tokens))
        return {"loaded": loaded}

    async def _pin_prefix(self, reg: Registration, req, keys: list, pages, signal: LoadSignal,
                          scope):
        """(host entries, pinned; chunks GDS queued; the host entries' page ids; remote
        fetches still landing): the host prefix, continued from disk, then from the remote
        store; each tier ends it at a chunk ``scope`` may not read (kvd/tiers/scope.py). With
        ``verify_loads`` the host prefix ends before a chunk that fails its checksum
        (kvd/server/load_verify.py). The remote fetches are returned still landing: the
        load copies each run as it lands (kvd/server/remote_load.py)."""
        entries = self.tier.ready_prefix(keys, scope)
        self.tier.pin(entries)
        ppc = scope.part // reg.layout.page_size if scope.part else reg.pages_per_chunk
        direct, fetches = 0, []
        try:
            if self.verifier is not None and entries:
                hits = len(entries)
                entries = await self.verifier.check(entries, reg.tp_rank)  # unpins the rest
                if len(entries) < hits:  # a corrupt chunk ends the prefix: no tier goes past it
                    return entries, 0, pages[:len(entries) * ppc], []
            host_pages = pages[:len(entries) * ppc]
            if scope.part:  # a partial entry lives in the host tier only
                return entries, 0, host_pages, []
            if self.tiering is not None and len(entries) < len(keys):
                direct, promoted, promoted_pages = await self._from_disk(
                    reg, req, keys, pages, len(entries), signal, scope)
                entries += promoted
                host_pages = np.concatenate([host_pages, promoted_pages])
            done = len(entries) + direct
            if self.remote is not None and done < len(keys):
                fetches = await self.remote.fetches(scope, keys[done:])
        except BaseException:
            self.tier.unpin(entries)
            raise
        return entries, direct, host_pages, fetches

    async def _from_disk(self, reg: Registration, req, keys: list, pages, hits: int,
                         signal: LoadSignal, scope):
        """The prefix past the first ``hits`` chunks, from disk: (chunks GPU Direct Storage
        queued, host entries promoted from disk (pinned), their page ids). GDS comes first;
        where it failed for IO reasons (not a bad chunk) the rest takes the host path."""
        ppc, direct = reg.pages_per_chunk, 0
        if self.gds is not None and self.gds.eligible(reg):
            cancel = (reg.flags.addr(reg.flags.layout.cancel_word(signal.slot)), signal.seq)
            direct, fallback = await self.gds.load(
                reg, keys[hits:], pages[hits * ppc:], self.tier,
                lambda: _check_deadline(req.fields.get("deadline_us")), cancel, scope)
            if not fallback:
                return direct, [], pages[:0]
        promoted = await self.tiering.promote_prefix(keys[hits + direct:], scope)
        first = (hits + direct) * ppc
        return direct, promoted, pages[first:first + len(promoted) * ppc]

    async def _queue_scatter(self, reg: Registration, req, entries: list, direct: int, host_pages,
                             signal: LoadSignal, stamps: dict, part: int = 0):
        """Queue the scatter (None: nothing to load, the slot released); ``part``: tokens of
        the partial entry it loads."""
        if not entries and not direct:
            signal.release()
            return None
        self._check_start(req, signal, direct)
        plan = CopyPlan(reg.pool, reg.layout, tokens := part or reg.ns.chunk_tokens, host_pages,
                        [e.shard_offset(reg.tp_rank) for e in entries], signal=signal,
                        after_device=direct > 0)
        return await self._start(reg, reg.engine.scatter(plan), "load",
                                 len(entries) * reg.layout.shard_bytes(tokens), stamps)

    @staticmethod
    def _check_start(req, signal: LoadSignal, direct: int) -> None:
        if signal.cancelled:
            raise Cancelled("the client cancelled the load before it started; nothing written")
        if not direct:  # GDS kernels already queued must be followed by the signals
            _check_deadline(req.fields.get("deadline_us"))

    async def _release_unqueued(self, reg: Registration, signal: LoadSignal, direct: int,
                                landed: list = ()) -> None:
        """A load that failed before its signal was queued still releases every wait on
        its slot: after the pieces it queued landed, and after GDS kernels it queued (on
        their stream), else at once."""
        await asyncio.gather(*landed, return_exceptions=True)
        if not direct:
            signal.release()
            return
        empty = CopyPlan(reg.pool, reg.layout, reg.ns.chunk_tokens, np.zeros(0, np.int64), [],
                         signal=signal)
        try:
            await self._start(reg, reg.engine.scatter(empty), "load", 0, {})
        except Exception:  # noqa: BLE001 - a broken GPU: the client's fence times out instead
            log.exception("could not queue the signals of a failed load")

    # ---- shared -------------------------------------------------------------------

    def _keys_and_pages(self, reg: Registration, req):
        """The request's keys and page ids, ``pages_per_chunk`` ids per key: a load's
        ``tail_pages`` (its last chunk's first pages only) padded with ``SKIP_PAGE``."""
        keys = wire.keys_from_frame(req.frames[0], self.cfg.max_keys_per_request)
        pages = wire.pages_from_frame(req.frames[1])
        ppc, tail = reg.pages_per_chunk, req.fields.get("tail_pages")
        if part := _part(reg, req):  # one key, a partial entry's: its pages
            if tail is not None or len(keys) != 1:
                raise BadRequest("part_tokens names exactly one key, without tail_pages")
            ppc = part // reg.layout.page_size
        if tail is not None and (not keys or not 1 <= tail < ppc):
            raise BadRequest(f"tail_pages must be between 1 and {ppc - 1} (a chunk's pages less "
                             f"one) and name the last of at least one key, got {tail}")
        need = len(keys) * ppc - (0 if tail is None else ppc - tail)
        if len(pages) != need:
            raise BadRequest(f"{len(keys)} chunks need {need} page ids, got {len(pages)}")
        if len(pages) and (pages.min() < 0 or pages.max() >= reg.layout.num_pages):
            raise OutOfRange(f"page ids must lie in [0, {reg.layout.num_pages})")
        if tail is not None:
            pages = np.concatenate([pages, np.full(ppc - tail, SKIP_PAGE, np.int64)])
        return keys, pages

    async def _start(self, reg: Registration, start, direction: str, nbytes: int,
                     stamps: dict) -> asyncio.Future:
        """Queue a copy of ``nbytes`` (``start``: the backend's gather/scatter coroutine)
        once the session may queue one more in that backend queue (kvd.server.copy_gate:
        fair to other clients, as backends run a queue's copies in the order they were
        queued), and track it on the registration until it lands."""
        gate, session = self.gate, reg.session
        queue = reg.engine.queue_of(reg.pool, direction)
        try:
            await gate.enter(session, queue, nbytes)
            stamps["gate"] = time.perf_counter()
        except BaseException:
            start.close()  # never awaited: no copy was queued
            raise

        def leave(_=None) -> None:
            gate.leave(session, queue, nbytes)
        try:
            landed = await start
            stamps["queued"] = time.perf_counter()
        except ServerError:
            leave()
            raise
        except BaseException as exc:
            leave()
            if not isinstance(exc, Exception):
                raise
            log.exception("copy could not start")
            raise CopyFailed(f"copy could not start: {type(exc).__name__}: {exc}") from None
        landed.add_done_callback(leave)
        reg.inflight.add(landed)
        landed.add_done_callback(reg.inflight.discard)
        landed.add_done_callback(_log_failure)
        return landed


async def _landed(landed: asyncio.Future) -> float:
    """Wait for a queued copy; returns the seconds waited. A copy is never left running
    unowned: a cancelled waiter still waits for it before giving up."""
    t0 = time.perf_counter()
    try:
        await asyncio.shield(landed)
    except asyncio.CancelledError:
        await asyncio.gather(landed, return_exceptions=True)
        raise
    except ServerError:
        raise
    except Exception as exc:
        raise CopyFailed(f"copy failed: {type(exc).__name__}: {exc}") from None
    return time.perf_counter() - t0


async def _landed_all(landed: list) -> float:
    """``_landed`` for each queued piece of a load; all of them land before an error goes
    out (their entries are unpinned after)."""
    waited = 0.0
    try:
        for fut in landed:
            waited += await _landed(fut)
    except BaseException:
        await asyncio.gather(*landed, return_exceptions=True)
        raise
    return waited


def _part(reg: Registration, req) -> int:
    """The tokens of the partial entry a store or load names (``part_tokens``), 0 for none."""
    value = req.fields.get("part_tokens")
    if value is None:
        return 0
    return wire.part_tokens_from_wire(value, reg.ns.chunk_tokens, reg.layout.page_size)


def _check_open(reg: Registration) -> None:
    if reg.closing:
        raise NotFound(f"registration {reg.id} was closed")


def _check_deadline(deadline_us) -> None:
    """Past the client's deadline: it stopped waiting and may reuse its pages, so a
    finished store cannot be trusted and a load must not start."""
    if deadline_us is not None and time.monotonic_ns() // 1000 > deadline_us:
        raise DeadlineExceeded("past the client's deadline; nothing kept or written")


def _log_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("copy failed: %r", future.exception())
