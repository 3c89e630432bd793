"""The copy engine interface every backend implements (``host``: kvd.copy.host; ``cuda``).

``open_pool(buffers, layout, flags, owner_uid)`` validates and maps an engine's KV buffers
(files must belong to ``owner_uid``); ``close_pool`` unmaps, only after the pool's copies
completed, never waiting on a GPU. ``gather``/``scatter(plan)`` return once the copy is
queued, with a future that resolves when the bytes landed or fails with the backend's
error; a scatter skips pages of id ``SKIP_PAGE`` (a load ending inside its last chunk); a
signalled scatter writes layer and done words and honours the cancel word; if it raises,
nothing was queued. ``queue_of(pool, direction)`` names the queue a copy joins.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Hashable, Protocol

import numpy as np

from kvd_protocol.layout import LayoutDescriptor

from .flags import FlagPage, LoadSignal


SKIP_PAGE = -1  # a scatter's page id that names no page: its rows are not copied


@dataclass
class CopyPlan:
    pool: object
    layout: LayoutDescriptor
    chunk_tokens: int
    # int64, pages_per_chunk ids per chunk, chunk-major; in a scatter, SKIP_PAGE for a page
    # not to write (the pages past a partial load's end: its last chunk's tail)
    page_ids: np.ndarray
    shard_offsets: list[int]  # arena byte offset of each chunk's shard
    signal: LoadSignal | None = None  # scatter only: the load's flag words
    # scatter only: kernels of this load were queued on the GPU before it (GPU Direct Storage's
    # chunks); its copies, words and completion must follow them
    after_device: bool = False

    @property
    def pages_per_chunk(self) -> int:
        return self.chunk_tokens // self.layout.page_size

    @property
    def layerwise(self) -> bool:
        return self.signal is not None and self.signal.layerwise


class CopyEngine(Protocol):
    name: str

    def open_pool(self, buffers: list[dict], layout: LayoutDescriptor, flags: FlagPage,
                  owner_uid: int | None = None) -> object: ...

    def close_pool(self, pool: object) -> None: ...

    def queue_of(self, pool: object, direction: str) -> Hashable | None:
        """The queue a copy of ``pool`` (``direction`` "store" or "load") joins, copies of
        one queue running in the order queued (kvd.server.copy_gate); None: the backend
        gains nothing from a client queuing ahead."""
        ...

    async def gather(self, plan: CopyPlan) -> asyncio.Future: ...

    async def scatter(self, plan: CopyPlan) -> asyncio.Future: ...

    def close(self) -> None: ...
