"""Client sessions, their KV pool registrations and their leases.

A session is created by ``hello`` and keyed by the client's ZeroMQ routing
id. It owns registrations (a mapped KV pool plus its namespace) and leases
(pins on cached entries with an expiry). Every request refreshes
``last_seen``; heartbeats keep an idle client alive. Copies in flight are
tracked per registration so that unregistering, ``bye`` and reaping wait
for them before a pool is unmapped. Registration and lease ids are global
and never reused, so another session's id is recognised as such.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

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
    inflight: set = field(default_factory=set)
    closing: bool = False

    @property
    def shard_bytes(self) -> int:
        return self.layout.shard_bytes(self.ns.chunk_tokens)

    @property
    def pages_per_chunk(self) -> int:
        return self.ns.chunk_tokens // self.layout.page_size

    async def drain(self) -> None:
        """Wait for every copy in flight on this pool (errors were already reported)."""
        while self.inflight:
            await asyncio.gather(*list(self.inflight), return_exceptions=True)


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
        return [s for s in self.by_peer.values() if not s.closing and now - s.last_seen > timeout_s]

    def expired_leases(self, now: float) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.expires <= now]
