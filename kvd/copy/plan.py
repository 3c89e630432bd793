"""The copy engine interface every backend implements.

``open_pool(buffers, layout, flags, owner_uid)`` maps an engine's KV buffers
(validated: kinds, sizes, every byte the layout can reach; files must belong
to ``owner_uid``, the registering process's uid from the kernel, or to the
daemon's user when that is unknown) and returns an opaque pool;
``flags`` is the registration's flag page (kvd.copy.flags), which the CUDA
backend also registers with the driver. ``close_pool(pool)`` unmaps it and
is called only after the pool's copies completed; it never waits on a GPU.

``gather(plan)`` copies engine pages into arena shards and ``scatter(plan)``
copies arena shards into engine pages (skipping the rows of a page id
``SKIP_PAGE``: a load that ends inside its last chunk, at a page boundary,
writes only that chunk's first pages). Both are coroutines that return
once the copy is *queued* (requests of one registration are queued in
arrival order by the service) with an ``asyncio.Future`` that resolves
(result None) when the bytes have landed, or fails with the backend's
error. A scatter with a ``signal`` writes the load's layer words (when
layer-wise) as layers land and its done word after its last copy, and
skips the engine's pages once the client wrote the slot's cancel word; if
it raises, nothing of the copy was queued. The caller keeps entries and
pools alive until the future is done. ``queue_of(pool, direction)`` names the
queue a copy joins (the CUDA backend: a GPU's stores, or its loads; the host
backend: None), for kvd.server.copy_gate's fair shares. Backends: ``host`` (numpy over shared
memory, kvd.copy.host) and ``cuda`` (CUDA IPC + kernels, kvd.cuda.backend).
The service picks the engine per pool by buffer kind.
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
