"""The copy engine interface every backend implements.

``open_pool(buffers, layout, events, owner_uid)`` maps an engine's KV buffers
(validated: kinds, sizes, every byte the layout can reach; files must belong
to ``owner_uid``, the registering process's uid from the kernel, or to the
daemon's user when that is unknown) and returns an opaque pool;
``close_pool(pool)`` unmaps it and is called only after the pool's copies
completed. ``gather(plan)`` copies engine pages into arena shards and
``scatter(plan)`` copies arena shards into engine pages; both return at
once with an ``asyncio.Future`` that resolves (result None) when the bytes
have landed, or fails with the backend's error. The caller keeps entries
and pools alive until that future is done. Backends: ``host`` (numpy over
shared memory, kvd.copy.host) and ``cuda`` (CUDA IPC + kernels,
kvd.cuda.backend). The service picks the engine per pool by buffer kind.
A CUDA pool also has interprocess events: ``events`` are the client's
(a gather may wait on one), and the pool's ``load_event_handles`` are the
per-layer events its layer-wise scatters record.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvd_protocol.layout import LayoutDescriptor


@dataclass
class CopyPlan:
    pool: object
    layout: LayoutDescriptor
    chunk_tokens: int
    page_ids: np.ndarray      # int64, pages_per_chunk ids per chunk, chunk-major
    shard_offsets: list[int]  # arena byte offset of each chunk's shard
    layers: range | None = None  # scatter only: a layer subrange
    wait_event: int | None = None  # gather only: index of a registered client event to wait on
    layerwise: bool = False        # scatter only: record per-layer events as layers land
    event_slot: int | None = None  # set by a layer-wise scatter: the event set it records

    @property
    def pages_per_chunk(self) -> int:
        return self.chunk_tokens // self.layout.page_size


class CopyEngine(Protocol):
    name: str

    def open_pool(self, buffers: list[dict], layout: LayoutDescriptor, events=(),
                  owner_uid: int | None = None) -> object: ...

    def close_pool(self, pool: object) -> None: ...

    def gather(self, plan: CopyPlan) -> asyncio.Future: ...

    def scatter(self, plan: CopyPlan) -> asyncio.Future: ...

    def close(self) -> None: ...
