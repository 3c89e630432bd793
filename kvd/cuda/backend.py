"""CUDA copy backend: engine KV pools opened through CUDA IPC, staged copies.

A pool buffer is ``{kind: "cuda_ipc", handle, offset, size, device_uuid}``:
the daemon maps the UUID to its own device ordinal (engines usually run
with CUDA_VISIBLE_DEVICES), opens the handle once on that device, checks
that ``offset + size`` lies inside the opened allocation, and closes it in
``close_pool`` (called only after the pool's copies completed); or a
``cuda_vmm`` buffer of virtual memory lent by file descriptor, mapped and
unmapped the same way (kvd.cuda.buffers). A CUDA
context, streams, the compiled kernels and the staging rings exist only on
devices some client registered memory on. The host arena is registered
with the driver as pinned (portable, in pieces) on first use.

Copy paths (``copy_path``): ``dma`` moves pages between the pool and the arena with the
copy engines only (``kvd.cuda.dma.path``; small pitched pages staged through the slots below,
``kvd.cuda.dma.stage``), for pools whose pages are byte ranges of at least
``dma_settings.min_piece`` bytes (``auto``; ``dma``: any size); no kernel of the daemon's
runs, so the engine keeps its GPU time slices (the driver calls of stores, and with
``gpu_dma_load_thread`` of loads, made by a thread of each GPU and direction, not the event
loop). Other pools (and every pool with ``kernels``) use SM kernels.
Kernel copies are staged (``kvd.cuda.dma.staging``): per GPU and direction a ring of
``stage_slots`` device buffers of ``stage_slot_bytes`` (2 x slots x bytes of the engine
GPU's memory: 256 MiB by default), kernels between the pool and the ring, DMA between the
ring and the arena. Where one layer of one chunk does not fit a slot (or ``stage_slots``
is 0), kernels read and write the arena directly through unified addressing (zero-copy).

Fault isolation: nothing of an engine's ever enters the daemon's streams. A store's
ordering after the engine's forward pass is checked by the service on the host (the flag
page's store word, kvd.copy.flags) before the gather is queued. A load signals through
its flag-page slot (kvd.cuda.signal): the kernel stream writes each layer's word as the
layer lands (layer-wise loads) and the done word after the last kernel; the copy kernels
skip the engine's pages once the client wrote the slot's cancel word. The flag page is
registered with the driver at ``open_pool`` and unregistered at ``close_pool``.
Completion of every copy is an event that the event loop polls while copies are in
flight (kvd.copy.poll), which resolves the asyncio future; the loop never blocks on the
GPU (a busy table slot of the kernel copier is awaited the same way), and ``close``
gives the GPU at most ``CLOSE_WAIT_S`` to finish before the process exits anyway. At
debug level it logs how long the enqueue and the copy took (kvd.cuda.completion).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvd.copy.flags import FlagPage
from kvd.copy.plan import CopyPlan
from kvd.copy.poll import EventPoller
from kvd.cuda import buffers as buffers_mod
from kvd.cuda.completion import completion, failed_after, gpu_start
from kvd.cuda.dma import path as dma
from kvd.cuda.dma.plan import pool_groups
from kvd.cuda.dma.staging import StagingRing
from kvd.cuda.kernels import KernelCopier, copy_params, plane_bases
from kvd.cuda.signal import GpuSignal
from kvd_protocol import cuda_driver
from kvd_protocol.errors import BadRequest, ServerError
from kvd_protocol.layout import LayoutDescriptor
from kvd_protocol.wire import describe

log = logging.getLogger("kvd")
REGISTER_PIECE = 1 << 30
STAGE_SLOTS, STAGE_SLOT_BYTES = 2, 64 << 20
CLOSE_WAIT_S = 5.0
COPY_PATHS = ("auto", "dma", "kernels")
_HOST_REGISTER = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped


@dataclass
class _Device:
    ordinal: int
    copier: KernelCopier
    streams: list              # [store kernels, store DMA, load kernels, load DMA]: stores and
    store: StagingRing | None  # loads have their own streams and slots, so both directions
    load: StagingRing | None   # of PCIe can be busy at once
    dma: dma.DmaPath | None = None


@dataclass
class CudaPool:
    device: _Device
    ptrs: list
    bases: np.ndarray
    flags: FlagPage
    by_dma: bool = False
    groups: list | None = None  # kvd.cuda.dma.plan.pool_groups, with by_dma
    closed: bool = False


class CudaCopyEngine:
    name = "cuda"

    def __init__(self, arena: np.ndarray, max_blocks: int = 32, stage_slots: int = STAGE_SLOTS,
                 stage_slot_bytes: int = STAGE_SLOT_BYTES, poll_interval_us: float = 0.0,
                 copy_path: str = "auto", dma_settings: dma.DmaSettings = dma.DmaSettings()):
        import cupy
        self.cp, self.rt = cupy, cupy.cuda.runtime
        self.arena, self.arena_ptr = arena, arena.ctypes.data
        self.max_blocks, self.stage = max_blocks, (stage_slots, stage_slot_bytes)
        if copy_path not in COPY_PATHS:
            raise ValueError(f"copy_path must be one of {', '.join(COPY_PATHS)}")
        self.copy_path = copy_path
        self.dma = dma_settings if copy_path == "auto" else dma_settings._replace(min_piece=1)
        self.devices: dict[int, _Device] = {}
        self.registered = False
        # 0: re-check copies every loop pass; > 0: sleep that long after checks that found none
        self.poller = EventPoller(0.0, poll_interval_us / 1e6) if poll_interval_us > 0 else EventPoller()
        # the driver's 16 bytes, as the engine's side reads them (kvd_protocol.cuda_driver):
        # the runtime's properties hand the UUID over as a C string, cut at its first 0 byte
        self.uuid_to_ordinal = {cuda_driver.device_uuid(i): i
                                for i in range(self.rt.getDeviceCount())}

    # ---- set-up -------------------------------------------------------------

    def _device(self, uuid: str) -> _Device:
        ordinal = self.uuid_to_ordinal.get(uuid)
        if ordinal is None:
            raise BadRequest(f"GPU {describe(uuid)} is not one of the daemon's {len(self.uuid_to_ordinal)}")
        dev = self.devices.get(ordinal)
        if dev is None:
            with self.cp.cuda.Device(ordinal):
                self._register_arena()
                dev = self._make_device(ordinal)
            self.devices[ordinal] = dev
            log.info("GPU %d (%s): kernels compiled, streams and %d x %d MiB staging slots ready",
                     ordinal, uuid, 2 * self.stage[0], self.stage[1] >> 20)
        return dev

    def _make_device(self, ordinal: int) -> _Device:
        copier = KernelCopier(ordinal, max_blocks=self.max_blocks)
        streams = [self.cp.cuda.Stream(non_blocking=True) for _ in range(4)]
        slots, slot_bytes = self.stage
        rings = [None, None]
        if slots > 0:
            pieces = (self.arena_ptr, REGISTER_PIECE)
            rings = [StagingRing(self.cp, kind, copier, streams[k], streams[k + 1], slots, slot_bytes,
                                 pieces) for k, kind in ((0, "gather"), (2, "scatter"))]
        path = None
        if self.copy_path != "kernels" and cuda_driver.has_memcpy3d_batch():
            path = dma.DmaPath(self.cp, ordinal, self.dma, (self.arena_ptr, REGISTER_PIECE),
                               self.poller, rings)
        elif self.copy_path != "kernels":
            log.warning("the CUDA driver has no cuMemcpy3DBatchAsync_v2 (CUDA 13 drivers): "
                        "copies use kernels")
        return _Device(ordinal, copier, streams, rings[0], rings[1], path)

    def _register_arena(self) -> None:
        if self.registered:
            return
        size = self.arena.nbytes
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and soft < size:
            log.warning("RLIMIT_MEMLOCK (%d bytes) is below the host tier (%d bytes); pinning may "
                        "fail: raise LimitMEMLOCK / ulimit -l", soft, size)
        t0 = time.monotonic()
        done = []
        try:
            for start in range(0, size, REGISTER_PIECE):
                self.rt.hostRegister(self.arena_ptr + start, min(REGISTER_PIECE, size - start),
                                     _HOST_REGISTER)
                done.append(self.arena_ptr + start)
            if self.rt.pointerGetAttributes(self.arena_ptr).devicePointer != self.arena_ptr:
                raise RuntimeError("this GPU cannot use host pointers of registered memory (no UVA)")
        except Exception:  # unwind, so a later registration can try again from scratch
            for ptr in done:
                self.rt.hostUnregister(ptr)
            raise
        self.registered = True
        log.info("host tier pinned for the GPU in %.2f s (%d pieces)", time.monotonic() - t0,
                 -(-size // REGISTER_PIECE))

    # ---- pools --------------------------------------------------------------

    def open_pool(self, buffers: list[dict], layout: LayoutDescriptor, flags: FlagPage,
                  owner_uid: int | None = None) -> CudaPool:  # IPC handles name no file: no owner
        uuids, kinds = {b.get("device_uuid") for b in buffers}, {b["kind"] for b in buffers}
        if len(kinds) != 1 or not kinds <= {"cuda_ipc", "cuda_vmm"} or len(uuids) != 1:
            raise BadRequest("a CUDA pool's buffers must all be cuda_ipc (or all cuda_vmm) "
                             "buffers of one GPU")
        try:
            dev = self._device(uuids.pop())
        except (BadRequest, ServerError):
            raise
        except Exception as exc:  # the daemon's own CUDA set-up failed: not the client's fault
            log.exception("setting up the GPU for a pool failed")
            raise ServerError(f"the daemon could not set up the GPU: {exc}") from None
        opened = []
        with self.cp.cuda.Device(dev.ordinal):
            try:
                ptrs = buffers_mod.open_all(self.rt, buffers, opened, dev.ordinal)
                layout.validate_extent([b["size"] for b in buffers])
                self._register_flags(flags)
            except ValueError as exc:
                self._close_ptrs(opened)
                raise BadRequest(f"layout does not fit its buffers: {exc}") from None
            except BaseException:
                self._close_ptrs(opened)
                raise
        bases = plane_bases(layout, ptrs)
        groups = None if dev.dma is None else pool_groups(layout, bases)
        by_dma = groups is not None and dma.eligible(layout, self.dma.min_piece, groups)
        if by_dma:
            log.info("GPU %d pool: copies by DMA, %d planes in %d pitched groups", dev.ordinal,
                     len(bases), len(groups))
        return CudaPool(dev, opened, bases, flags, by_dma, groups)

    def _register_flags(self, flags: FlagPage) -> None:
        try:
            self.rt.hostRegister(flags.ptr, flags.size, _HOST_REGISTER)
        except Exception as exc:
            raise ServerError(f"the daemon could not register the flag page with CUDA: {exc}") from None
        if self.rt.pointerGetAttributes(flags.ptr).devicePointer != flags.ptr:
            self.rt.hostUnregister(flags.ptr)
            raise ServerError("this GPU cannot use host pointers of registered memory (no UVA)")

    def _close_ptrs(self, opened) -> None:
        buffers_mod.close_all(self.rt, opened)

    def vmm_supported(self) -> bool:
        """Whether pools lent by file descriptor (``cuda_vmm``) can be mapped on every GPU."""
        return buffers_mod.vmm_supported(self.uuid_to_ordinal.values())

    def queue_of(self, pool: CudaPool, direction: str) -> tuple:
        return pool.device.ordinal, direction  # a GPU's stores, or its loads: one queue each

    def close_pool(self, pool: CudaPool) -> None:
        """Unmap the pool. The service calls it once the pool's copies completed (their
        events were polled), so nothing here waits on the GPU."""
        with self.cp.cuda.Device(pool.device.ordinal):
            self._close_ptrs(pool.ptrs)
            try:
                self.rt.hostUnregister(pool.flags.ptr)
            except Exception as exc:  # noqa: BLE001 - a broken context: nothing more to undo
                log.warning("unregistering a flag page failed: %s", exc)
        pool.closed = True

    # ---- copies -------------------------------------------------------------

    def _chunk_ptrs(self, plan: CopyPlan) -> np.ndarray:
        return np.asarray(plan.shard_offsets, dtype=np.uint64) + np.uint64(self.arena_ptr)

    async def table_slot(self, dev: _Device) -> None:
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
    def _scatter_direct(dev: _Device, pool: CudaPool, plan: CopyPlan, ptrs, geometry: dict,
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

    def close(self) -> None:
        """Free every GPU resource; gives queued copies ``CLOSE_WAIT_S`` to finish. The
        daemon exits right after, so a GPU that does not finish in time (it cannot wait
        on anything of another process) only delays the exit, never hangs it."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        idle = all(self._drain(dev, deadline) for dev in self.devices.values())
        if not idle:
            log.warning("GPU copies still queued after %.0f s at shutdown; exiting anyway",
                        CLOSE_WAIT_S)
            return  # freeing memory a queued copy uses would be worse than leaking it
        for dev in self.devices.values():
            with self.cp.cuda.Device(dev.ordinal):
                for ring in filter(None, (dev.store, dev.load, dev.dma)):
                    ring.close()
        if self.registered:
            for start in range(0, self.arena.nbytes, REGISTER_PIECE):
                self.rt.hostUnregister(self.arena_ptr + start)

    def _drain(self, dev: _Device, deadline: float) -> bool:
        if dev.dma is not None and not dev.dma.settle(max(0.0, deadline - time.monotonic())):
            return False
        with self.cp.cuda.Device(dev.ordinal):
            streams = dev.streams + ([] if dev.dma is None else dev.dma.streams)
            events = [self.cp.cuda.Event(block=False, disable_timing=True) for _ in streams]
            for ev, stream in zip(events, streams):
                ev.record(stream)
            while not all(ev.done for ev in events):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.001)
        return True


def _plan(ring: StagingRing | None, plan: CopyPlan, layers: range, per_layer: bool):
    """The ring's pieces for this copy, or None (no ring, or a layer too large for a slot)."""
    if ring is None:
        return None
    layer_bytes = plan.layout.planes * plan.chunk_tokens * plan.layout.row_bytes
    return ring.plan(len(plan.shard_offsets), layers.start, layers.stop, layer_bytes, per_layer)
