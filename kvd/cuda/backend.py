"""CUDA copy backend: engine KV pools opened through CUDA IPC, copies by DMA or kernels.

Owns per-GPU contexts, streams, kernels and staging rings (only on devices a client
registered memory on), and the arena's pinned registration. Pool buffers are ``cuda_ipc``
or ``cuda_vmm`` (kvd.cuda.buffers), checked against the opened allocation. ``copy_path``:
``dma`` (copy engines only, kvd.cuda.dma.path) for byte-range pages, else SM kernels staged
through a slot ring (kvd.cuda.dma.staging) or zero-copy. Promises: nothing of an engine's
enters the daemon's streams; loads signal through the flag page (kvd.cuda.signal);
completion is a polled event (kvd.copy.poll). Never blocks the loop on the GPU;
``close`` gives it at most ``CLOSE_WAIT_S``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from kvd.copy.plan import CopyPlan
from kvd.cuda.completion import completion, failed_after, gpu_start
from kvd.cuda.devices import CudaDevices, CudaPool, GpuDevice
from kvd.cuda.dma import path as dma
from kvd.cuda.dma.staging import StagingRing
from kvd.cuda.kernels import copy_params
from kvd.cuda.signal import GpuSignal
from kvd_protocol.layout import LayoutDescriptor


class CudaCopyEngine(CudaDevices):
    name = "cuda"

    # ---- copies -------------------------------------------------------------

    def _chunk_ptrs(self, plan: CopyPlan) -> np.ndarray:
        return np.asarray(plan.shard_offsets, dtype=np.uint64) + np.uint64(self.arena_ptr)

    async def table_slot(self, dev: GpuDevice) -> None:
        """Wait, without blocking the loop, until the copier's next table slot is free
        (call right before queueing a copy, with no await in between)."""
        while (busy := dev.copier.busy_slot()) is not None:
            await self.poller.wait(busy)

    async def gather(self, plan: CopyPlan) -> asyncio.Future:
        t0 = time.perf_counter()
        pool, dev = plan.pool, plan.pool.device
        ptrs, layers = self._chunk_ptrs(plan), range(plan.layout.num_layers)
        if pool.by_dma:
            with self.cp.cuda.Device(dev.ordinal):
                start = None if dev.dma.store_hand else gpu_start(self.cp, dev.dma.store_queue.stream)
                stream, how, done = dev.dma.store(plan.layout, pool.bases, pool.groups,
                                                  plan.page_ids, ptrs, plan.chunk_tokens)
                return completion(self.cp, self.poller, stream, "gather", plan, how, t0, start,
                                  then=dev.dma.store_queue.landed, done=done)
        await self.table_slot(dev)
        geometry = copy_params(plan.layout, plan.chunk_tokens)
        with self.cp.cuda.Device(dev.ordinal):
            if (pieces := _plan(dev.store, plan, layers, False)) is not None:
                how = f"{len(pieces)} staged pieces"
                stream = dev.store.run(pieces, pool.bases, plan.page_ids, ptrs, geometry)
            else:
                stream, how = dev.streams[0], "zero-copy kernel"
                dev.copier.gather(pool.bases, plan.page_ids, ptrs, stream=stream, **geometry)
            return completion(self.cp, self.poller, stream, "gather", plan, how, t0)

    async def scatter(self, plan: CopyPlan) -> asyncio.Future:
        t0 = time.perf_counter()
        pool, dev = plan.pool, plan.pool.device
        layers = range(plan.layout.num_layers)
        signal, ptrs = GpuSignal.of(plan.signal), self._chunk_ptrs(plan)
        if pool.by_dma and len(ptrs):
            return await self._scatter_dma(plan, ptrs, signal, t0)
        await self.table_slot(dev)
        geometry = copy_params(plan.layout, plan.chunk_tokens)
        with self.cp.cuda.Device(dev.ordinal):
            stream, failed = dev.streams[2], None
            try:
                if not len(ptrs):  # everything came another way (kvd.cuda.gds): signals only
                    how = "no host chunks"
                    if signal is not None and signal.layerwise:
                        signal.layers_landed(stream, layers)
                elif (pieces := _plan(dev.load, plan, layers, plan.layerwise)) is not None:
                    how = f"{len(pieces)} staged pieces"
                    stream = dev.load.run(pieces, pool.bases, plan.page_ids, ptrs, geometry,
                                          signal=signal)
                else:
                    how = "zero-copy kernels"
                    self._scatter_direct(dev, pool, plan, ptrs, geometry, signal)
            except Exception as exc:  # noqa: BLE001 - reported once what was queued landed
                failed, how = exc, "failed"
            return self._fence(stream, signal, plan, how, t0, failed=failed)

    async def _scatter_dma(self, plan: CopyPlan, ptrs, signal: GpuSignal | None,
                           t0: float) -> asyncio.Future:
        """Queue what the load window admits now, the rest in a task, or all by the load
        thread; the future ends after the last queued byte landed: no pool closes under it."""
        pool = plan.pool
        dev, stream = pool.device, pool.device.dma.load_queue.stream
        args = (plan.layout, pool.bases, pool.groups, plan.page_ids, ptrs, plan.chunk_tokens, signal)

        def finish(how: str, failed: Exception | None = None) -> asyncio.Future:
            with self.cp.cuda.Device(dev.ordinal):
                return self._fence(stream, signal, plan, how, t0, start,
                                   dev.dma.load_queue.landed, failed)

        with self.cp.cuda.Device(dev.ordinal):
            start = None if dev.dma.load_hand else gpu_start(self.cp, stream)
            if plan.after_device:  # GDS's kernels of this load (scatter_device): first
                dev.dma.load_queue.follow(dev.streams[2])
        try:
            if dev.dma.load_hand is not None:
                return completion(self.cp, self.poller, None, "scatter", plan, dma.DIRECT, t0,
                                  then=dev.dma.load_queue.landed, done=dev.dma.hand_load(*args))
            how, rest = dev.dma.load(*args)
        except Exception as exc:  # noqa: BLE001 - reported once what was queued landed
            return finish(dma.DIRECT, exc)
        if rest is None:
            return finish(how)

        async def feed() -> None:
            try:
                await rest()
            finally:  # an error too waits for what was queued
                await finish(how)
        return asyncio.ensure_future(feed())

    @staticmethod
    def _scatter_direct(dev: GpuDevice, pool: CudaPool, plan: CopyPlan, ptrs, geometry: dict,
                        signal: GpuSignal | None) -> None:
        """Kernels reading the pinned arena directly (zero-copy), layer by layer when
        the load signals each layer."""
        stream = dev.streams[2]
        cancel = None if signal is None else signal.cancel
        with dev.copier.batch("scatter", pool.bases, plan.page_ids, ptrs, stream=stream,
                              cancel=cancel, **geometry) as batch:
            if not plan.layerwise:
                batch.launch_all()
                return
            for layer in range(plan.layout.num_layers):
                batch.launch_all(layer, layer + 1)
                signal.layers_landed(stream, (layer,))

    def scatter_device(self, pool: CudaPool, layout: LayoutDescriptor, page_ids, ptrs: list,
                       chunk_tokens: int, cancel: tuple[int, int] | None = None):
        """Queue kernels scattering whole chunks already in this GPU's memory at ``ptrs``
        into ``page_ids``, on the load kernel stream (returned): a later ``scatter`` (by DMA:
        with ``plan.after_device``) follows them, signals and completion included.
        ``cancel``: the load's cancel word and seq (the kernels skip once it is set)."""
        dev = pool.device
        geometry = copy_params(layout, chunk_tokens)
        with self.cp.cuda.Device(dev.ordinal):
            dev.copier.scatter(pool.bases, page_ids, ptrs, stream=dev.streams[2], cancel=cancel,
                               **geometry)
        return dev.streams[2]

    def _fence(self, stream, signal: GpuSignal | None, plan: CopyPlan, how: str, t0: float,
               start: Any = None, then: Any = None, failed: Exception | None = None):
        """A load's end: the done word after whatever was queued on ``stream``, then the
        completion future (failing with ``failed`` only once that landed)."""
        if signal is not None:
            signal.done(stream)
        landed = completion(self.cp, self.poller, stream, "scatter", plan, how, t0, start, then)
        return failed_after(landed, failed)


def _plan(ring: StagingRing | None, plan: CopyPlan, layers: range, per_layer: bool):
    """The ring's pieces for this copy, or None (no ring, or a layer too large for a slot)."""
    if ring is None:
        return None
    layer_bytes = plan.layout.planes * plan.chunk_tokens * plan.layout.row_bytes
    return ring.plan(len(plan.shard_offsets), layers.start, layers.stop, layer_bytes, per_layer)
