"""A load whose prefix goes on in the remote store: local copy first, then each remote run as it lands.

``queue_pieces`` (called by kvd.server.transfers for a load with remote hits) queues the
local prefix's copy at once, then awaits the remote fetches in key order and queues each
finished run's copy (pinned via ``hold_ready``), so the remote part costs about
max(fetch, copy). A failed or timed-out fetch ends the prefix there (a shorter load, never an
error). The load's signal goes with the last piece, after every earlier piece landed, so
its done word and layer words follow every byte. ``pieces.landed`` holds every queued copy;
``pieces.signalled`` says whether the signal was queued.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from kvd.copy.plan import CopyPlan
from kvd.tiers.disk.tiering import hold_ready
from kvd_protocol.errors import NotFound


@dataclass
class Pieces:
    landed: list = field(default_factory=list)
    signalled: bool = False
    chunks: int = 0  # chunks in the queued pieces


async def queue_pieces(tr, reg, pages, keys: list, entries: list, direct: int, host_pages,
                       fetches: list, signal, stamps: dict, pieces: Pieces, scope) -> None:
    """Queue the local prefix's copy, then each landed run of ``fetches`` (the remote hits
    ``keys[len(entries) + direct:]``), the last one with ``signal``."""
    ppc, done = reg.pages_per_chunk, len(entries) + direct
    if entries:
        await _piece(tr, reg, host_pages, entries, None, direct > 0, stamps, pieces)
    i, n = 0, len(fetches)
    while i < n:
        # shielded: a cancelled load must not cancel fetches other requests wait for
        await asyncio.gather(asyncio.shield(fetches[i]), return_exceptions=True)
        j = i + 1
        while j < n and fetches[j].done():  # every landed fetch joins this piece
            j += 1
        run = hold_ready(tr.remote.host, keys[done + i:done + j], scope)
        entries += run
        if signal.cancelled:
            break  # the client gave up: its pages are left alone from here
        first = (done + i) * ppc
        last = len(run) == j - i and j == n
        if run:
            tr.remote.counters["load_pieces"] += 1
            await _piece(tr, reg, pages[first:first + len(run) * ppc], run,
                         signal if last else None, direct > 0, stamps, pieces)
        if len(run) < j - i:
            break  # a fetch failed or timed out: a miss for it and the rest of the prefix
        i = j
    if not pieces.signalled:  # nothing was left to carry it: the words alone
        await _piece(tr, reg, np.zeros(0, np.int64), [], signal, direct > 0, stamps, pieces)


async def _piece(tr, reg, page_ids, run: list, signal, after_device: bool, stamps: dict,
                 pieces: Pieces) -> None:
    if reg.closing:  # reaped while fetches landed: its pool goes next
        raise NotFound(f"registration {reg.id} was closed")
    if signal is not None and pieces.landed:  # the done word follows every byte, any backend
        await asyncio.gather(*pieces.landed, return_exceptions=True)
    plan = CopyPlan(reg.pool, reg.layout, reg.ns.chunk_tokens, page_ids,
                    [e.shard_offset(reg.tp_rank) for e in run], signal=signal,
                    after_device=after_device)
    pieces.landed.append(await tr._start(reg, reg.engine.scatter(plan), "load",
                                         len(run) * reg.shard_bytes, stamps))
    pieces.chunks += len(run)
    pieces.signalled = signal is not None
