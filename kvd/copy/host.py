"""Host copy backend: engine KV pools in shared-memory files, copies in numpy.

Serves CPU engines and runs the whole protocol without a GPU. A pool buffer is
``{kind: "shm", path, size}``, checked and mapped by kvd.copy.shm_file. Copies run on a
small thread pool (numpy releases the GIL) and complete through asyncio futures; large
gathers/scatters split into parts of whole chunks (one thread's memcpy is a fraction of a
host's bandwidth). A signalled scatter writes layer words as layers land, checks the
cancel word per layer, and always writes the done word last.
"""

from __future__ import annotations

import asyncio
import os
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


SPLIT_MIN_BYTES = 8 << 20  # a part of a split copy moves at least this much
AUTO_THREADS_MAX = 16  # the most measured (a 16-core host): a node's many GPUs' engines need cores too


def auto_threads() -> int:
    """``copy_threads`` 0: one thread per CPU this process may run on, at most AUTO_THREADS_MAX."""
    return max(1, min(AUTO_THREADS_MAX, len(os.sched_getaffinity(0))))


@dataclass
class HostPool:
    maps: list
    arrays: list


class HostCopyEngine:
    name = "host"

    def __init__(self, arena: np.ndarray, shm_dir: Path, threads: int = 0,
                 arena_id: tuple[int, int] | None = None):
        self.arena = arena
        self.arena_id = arena_id  # (st_dev, st_ino) of the arena: never mapped as a pool
        self.shm_dir = Path(shm_dir).resolve()
        self.threads = threads or auto_threads()
        self.executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kvd-copy")

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
        parts = self._parts(plan)
        if len(parts) == 1:
            return self._submit(host_ops.gather, *self._args(plan, parts[0]))
        return asyncio.ensure_future(self._all(plan, parts, host_ops.gather))

    async def scatter(self, plan: CopyPlan) -> asyncio.Future:
        parts = [] if plan.layerwise else self._parts(plan)
        if len(parts) < 2:
            return self._submit(self._scatter, plan)
        return asyncio.ensure_future(self._all(plan, parts, host_ops.scatter, plan.signal))

    def _parts(self, plan: CopyPlan) -> list[range]:
        """Whole-chunk ranges of the copy, one per thread that gets at least SPLIT_MIN_BYTES."""
        d, chunks = plan.layout, len(plan.shard_offsets)
        chunk_bytes = d.num_layers * d.planes * plan.chunk_tokens * d.row_bytes
        n = max(1, min(self.threads, chunks, chunks * chunk_bytes // SPLIT_MIN_BYTES))
        bounds = [chunks * i // n for i in range(n + 1)]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]

    def _args(self, plan: CopyPlan, chunks: range) -> tuple:
        ppc = plan.pages_per_chunk
        return (plan.pool.arrays, self.arena, plan.layout, plan.chunk_tokens,
                plan.page_ids[chunks.start * ppc:chunks.stop * ppc],
                plan.shard_offsets[chunks.start:chunks.stop])

    async def _all(self, plan: CopyPlan, parts: list[range], copy, signal: LoadSignal | None = None):
        try:
            if signal is not None and signal.cancelled:
                return  # the client gave up on this load: leave its pages alone
            futures = [self._submit(copy, *self._args(plan, p)) for p in parts]
            try:
                await asyncio.shield(asyncio.wait(futures))
            except asyncio.CancelledError:
                await asyncio.wait(futures)  # threads still copy: the done word must follow them
                raise
            failed = [e for e in (f.exception() for f in futures) if e is not None]
            if failed:
                raise failed[0]
        finally:
            if signal is not None:
                signal.page.signal_done(signal.slot, signal.seq)

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
