"""A load whose prefix goes on in the remote store: the local part's copy first, then each
remote run's copy as its fetches land.

Contract (kvd.server.transfers.Transfers.load calls ``queue_pieces`` for a load that has
remote hits past its local prefix, layer-wise or not; ``fetches`` are the remote tier's
futures for those hits, in key order, kvd.tiers.remote.tiering.RemoteTiering.fetches):

- the copy of the local prefix (host entries, disk promotions) is queued at once, without
  the load's signal;
- the remote hits are awaited in key order; every run of chunks whose fetches finished is
  pinned (``hold_ready``: its entries join ``entries``, which the caller unpins) and its copy
  queued at once, so the remote part costs about max(fetch, copy) instead of their sum;
- a fetch that failed or timed out ends the prefix at that chunk: no later chunk is
  copied (a shorter load, never an error);
- the load's signal goes with the last piece, queued once every earlier piece landed, so
  on any backend its done word follows every byte of the load, and a layer-wise load's
  word of layer l follows every earlier piece and layer l of the last (the engine's
  layers stay in order; a load with a remote part signals its first layer only once
  that part landed, never before its bytes); a piece that lands
  with an error still lets the signal go out (the load then fails with ``CopyFailed``);
- ``pieces.landed`` holds every queued copy; ``pieces.signalled`` says whether the
  signal was queued (if not, the caller releases the slot after the landed pieces).
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
