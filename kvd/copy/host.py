"""Host copy backend: engine KV pools in shared-memory files, copies in numpy.

Serves CPU inference engines and runs the whole protocol where there is no
GPU. A pool buffer is ``{kind: "shm", path, size}``: a regular file inside
the configured shm directory, owned by the registering process's uid,
checked and mapped by kvd.copy.shm_file (the daemon's own arena is refused). Copies run on a small thread pool (numpy
releases the GIL for the bulk of a copy) and complete through asyncio
futures. A scatter with a signal copies layer by layer when layer-wise
(writing each layer's word as it lands, so a CPU engine can start on layer
0 early), checks the slot's cancel word before each layer, and writes the
done word last, whatever happened.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvd_protocol.errors import BadRequest
from kvd_protocol.layout import LayoutDescriptor

from . import host_ops
from .flags import FlagPage, LoadSignal
from .plan import CopyPlan
from .shm_file import map_shm_file


@dataclass
class HostPool:
    maps: list
    arrays: list


class HostCopyEngine:
    name = "host"

    def __init__(self, arena: np.ndarray, shm_dir: Path, threads: int = 2,
                 arena_id: tuple[int, int] | None = None):
        self.arena = arena
        self.arena_id = arena_id  # (st_dev, st_ino) of the arena: never mapped as a pool
        self.shm_dir = Path(shm_dir).resolve()
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvd-copy")

    def open_pool(self, buffers: list[dict], layout: LayoutDescriptor, flags: FlagPage | None = None,
                  owner_uid: int | None = None) -> HostPool:
        maps = []
        try:
            for i, b in enumerate(buffers):
                if b["kind"] != "shm":
                    raise BadRequest(f"buffers[{i}]: the host backend takes only shm buffers")
                maps.append(map_shm_file(b["path"], b["size"], self.shm_dir, f"buffers[{i}]",
                                         self.arena_id, owner_uid))
            try:
                layout.validate_extent([b["size"] for b in buffers])
            except ValueError as exc:
                raise BadRequest(f"layout does not fit its buffers: {exc}") from None
        except BaseException:
            for m in maps:
                m.close()
            raise
        return HostPool(maps, [np.frombuffer(m, dtype=np.uint8) for m in maps])

    def close_pool(self, pool: HostPool) -> None:
        pool.arrays.clear()
        for m in pool.maps:
            try:
                m.close()
            except BufferError:
                pass  # a view is still alive somewhere; unmapped when collected

    def queue_of(self, pool: HostPool, direction: str) -> None:
        return None  # one thread pool for every client: queuing ahead only takes its threads

    def _submit(self, fn, *args) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def gather(self, plan: CopyPlan) -> asyncio.Future:
        return self._submit(host_ops.gather, plan.pool.arrays, self.arena, plan.layout,
                            plan.chunk_tokens, plan.page_ids, plan.shard_offsets)

    async def scatter(self, plan: CopyPlan) -> asyncio.Future:
        return self._submit(self._scatter, plan)

    def _scatter(self, plan: CopyPlan) -> None:
        signal: LoadSignal | None = plan.signal
        args = (plan.pool.arrays, self.arena, plan.layout, plan.chunk_tokens, plan.page_ids,
                plan.shard_offsets)
        try:
            if signal is None:
                host_ops.scatter(*args)
                return
            for layers in _layer_steps(plan.layout.num_layers, signal.layerwise):
                if signal.cancelled:
                    return  # the client gave up on this load: leave its pages alone
                host_ops.scatter(*args, layers)
                if signal.layerwise:
                    for layer in layers:
                        signal.page.signal_layer(signal.slot, layer, signal.seq)
        finally:
            if signal is not None:
                if signal.layerwise:  # a copy that failed midway still releases every wait
                    signal.page.release(signal.slot, signal.seq, True)
                signal.page.signal_done(signal.slot, signal.seq)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def _layer_steps(num_layers: int, per_layer: bool) -> list[range]:
    return [range(i, i + 1) for i in range(num_layers)] if per_layer else [range(num_layers)]
