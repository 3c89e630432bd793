"""Client sessions, their KV pool registrations and their leases.

A session is made by ``hello`` and keyed by the client's routing id (a new ``hello``
replaces it). It owns registrations (mapped pool, flag page, namespace) and leases (pins
with an expiry). Requests and heartbeats refresh ``last_seen``; a session with requests in
flight is never reaped. Per registration ``turn`` orders copies by arrival, ``waiting``
holds requests waiting on the client (cancelled at reaping), ``inflight`` and ``used``
are waited for before the pool is unmapped. Registration and lease ids are never reused.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvd.tiers.scope import Scope
from kvd_protocol import wire
from kvd_protocol.keys import Namespace
from kvd_protocol.layout import LayoutDescriptor


@dataclass(eq=False)
class Registration:
    id: int
    session: "Session"
    ns: Namespace
    ns_digest: bytes
    tp_rank: int  # the shard this pool fills: the TP rank, or 0 for MLA
    layout: LayoutDescriptor
    pool: object
    engine: object
    flags: object  # kvd.copy.flags.FlagPage
    files: tuple = ()  # the client's shm files mapped (kvd.server.leftovers.identify)
    inflight: set = field(default_factory=set)
    waiting: set = field(default_factory=set)
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    closing: bool = False
    users: int = 0  # stores and loads using the pool or the flag page now
    unused_now: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.unused_now.set()

    @property
    def shard_bytes(self) -> int:
        return self.layout.shard_bytes(self.ns.chunk_tokens)

    def scope(self, part: int = 0) -> Scope:
        """What this registration's requests may read (a new one per request: it counts
        the chunks of other namespaces it turned away); ``part``: partial entries of that
        many tokens instead of whole chunks."""
        if self.layout is None:  # attach: no layout
            shard_bytes = None
        else:
            shard_bytes = self.layout.shard_bytes(part) if part else self.shard_bytes
        return Scope(self.ns_digest, self.ns.shards, shard_bytes, part)

    def lookup_keys(self, req, max_keys: int) -> tuple[list, list]:
        """A lookup's chain keys, and its partial keys (``part_tokens``, protocol §8.5) as
        (key, tokens) pairs: the last keys of its frame."""
        keys = wire.keys_from_frame(req.frames[0], max_keys)
        if "part_tokens" not in req.fields:
            return keys, []
        page = self.layout.page_size if self.layout is not None else None
        counts = wire.part_candidates_from_wire(req.fields["part_tokens"], self.ns.chunk_tokens,
                                                page, len(keys))
        chain = len(keys) - len(counts)
        return keys[:chain], list(zip(keys[chain:], counts))

    def part_hit(self, tier, parts: list, hits: list, whole: bool) -> dict:
        """A lookup's answer for its partial keys (``{}``: it asked for none): the tokens of the
        first ``tier`` holds ready as a partial entry of that length, when the chain hit
        ``whole``; that entry joins ``hits`` (a lease pins it)."""
        if not parts:
            return {}
        for key, tokens in parts if whole else ():
            found = tier.ready_prefix([key], self.scope(tokens))
            if found:
                found[0].hits += 1
                hits.append(found[0])
                return {"part": tokens}
        return {"part": None}

    @property
    def pages_per_chunk(self) -> int:
        return self.ns.chunk_tokens // self.layout.page_size

    @contextmanager
    def used(self):
        """A request using the pool or the flag page: take it in the same loop step as the
        check that the registration is open, so closing (``unused``) waits for it."""
        self.users += 1
        self.unused_now.clear()
        try:
            yield self
        finally:
            self.users -= 1
            if not self.users:
                self.unused_now.set()

    async def unused(self) -> None:
        """Wait until no request uses the pool or the flag page (each such wait is
        bounded: closing cancelled the waits on the client, copies never wait on
        another process)."""
        while self.users:
            await self.unused_now.wait()

    async def drain(self) -> None:
        """Cancel the requests waiting on the client, then wait for every copy in flight
        on this pool (errors were already reported)."""
        for task in list(self.waiting):
            task.cancel()
        while self.inflight or self.waiting:
            await asyncio.gather(*list(self.inflight), *list(self.waiting), return_exceptions=True)


@dataclass(eq=False)
class Lease:
    id: int
    session: "Session"
    entries: list
    expires: float


@dataclass(eq=False)
class Session:
    peer: bytes
    name: str
    pid: int
    cred: object = None  # kvd.server.peers.PeerCred of its connection (from the kernel), or None
    last_seen: float = field(default_factory=time.monotonic)
    registrations: dict = field(default_factory=dict)
    leases: dict = field(default_factory=dict)
    inflight: int = 0  # requests of this session being served now
    closing: bool = False


class SessionTable:
    def __init__(self):
        self.by_peer: dict[bytes, Session] = {}
        self.registrations: dict[int, Registration] = {}
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    def __len__(self) -> int:
        return len(self.by_peer)

    def stale(self, timeout_s: float, now: float) -> list[Session]:
        """Sessions silent for ``timeout_s``, except those the daemon is serving a request
        of (a long copy is not silence). Requests that wait on the client itself (a
        store waiting for the engine's stream) do not count: a dead client never
        completes them, and reaping cancels them."""
        return [s for s in self.by_peer.values()
                if not s.closing and now - s.last_seen > timeout_s
                and s.inflight <= sum(len(r.waiting) for r in s.registrations.values())]

    def expired_leases(self, now: float) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.expires <= now]
