"""CUDA copy backend: engine KV pools opened through CUDA IPC, staged copies.

A pool buffer is ``{kind: "cuda_ipc", handle, offset, size, device_uuid}``:
the daemon maps the UUID to its own device ordinal (engines usually run
with CUDA_VISIBLE_DEVICES), opens the handle once on that device, checks
that ``offset + size`` lies inside the opened allocation, and closes it in
``close_pool`` (called only after the pool's copies completed). A CUDA
context, streams, the compiled kernels and the staging rings exist only on
devices some client registered memory on. The host arena is registered
with the driver as pinned (portable, in pieces) on first use.

Copies are staged (``kvd.cuda.staging``): per GPU and direction a ring of
``stage_slots`` device buffers of ``stage_slot_bytes`` (2 x slots x bytes of
the engine GPU's memory: 128 MiB by default), kernels between the pool and
the ring, DMA between the ring and the arena. Where one layer of one chunk
does not fit a slot (or ``stage_slots`` is 0), kernels read and write the
arena directly through unified addressing instead (zero-copy).

Ordering: a store may name one of the client's interprocess events; the
daemon's first copy waits on it. A layer-wise load records one
interprocess event per layer once that layer landed (a ring of
``LOAD_SLOTS`` sets per pool), so the engine's stream can wait for layer i
while later layers still copy. Completion of every copy is an event that
the event loop polls while copies are in flight (kvd.cuda.poll), which
resolves the asyncio future; at debug level it logs how long the enqueue
and the copy took.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass

import numpy as np

from kvd.copy.plan import CopyPlan
from kvd.cuda.kernels import KernelCopier, desc_params, plane_bases
from kvd.cuda.poll import EventPoller
from kvd.cuda.staging import StagingRing
from kvd_protocol import cuda_driver
from kvd_protocol.errors import BadRequest
from kvd_protocol.layout import LayoutDescriptor

log = logging.getLogger("kvd")
LOAD_SLOTS = 4
REGISTER_PIECE = 1 << 30
STAGE_SLOTS = 2
STAGE_SLOT_BYTES = 32 << 20
_EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess
_IPC_LAZY_PEER = 1        # cudaIpcMemLazyEnablePeerAccess


@dataclass
class _Device:
    ordinal: int
    copier: KernelCopier
    streams: list              # [store kernels, store DMA, load kernels, load DMA]: stores and
    store: StagingRing | None  # loads have their own streams and slots, so both directions
    load: StagingRing | None   # of PCIe can be busy at once


@dataclass
class CudaPool:
    device: _Device
    ptrs: list
    bases: np.ndarray
    store_events: list
    load_events: list  # [slot][layer] raw event handles
    load_event_handles: list
    next_slot: int = 0
    closed: bool = False


class CudaCopyEngine:
    name = "cuda"

    def __init__(self, arena: np.ndarray, max_blocks: int = 32, stage_slots: int = STAGE_SLOTS,
                 stage_slot_bytes: int = STAGE_SLOT_BYTES):
        import cupy
        self.cp = cupy
        self.rt = cupy.cuda.runtime
        self.arena = arena
        self.arena_ptr = arena.ctypes.data
        self.max_blocks = max_blocks
        self.stage = (stage_slots, stage_slot_bytes)
        self.devices: dict[int, _Device] = {}
        self.registered = False
        self.poller = EventPoller()
        self.uuid_to_ordinal = {bytes(self.rt.getDeviceProperties(i)["uuid"]).hex(): i
                                for i in range(self.rt.getDeviceCount())}

    # ---- set-up -------------------------------------------------------------

    def _device(self, uuid: str) -> _Device:
        ordinal = self.uuid_to_ordinal.get(uuid)
        if ordinal is None:
            raise BadRequest(f"GPU {uuid} is not visible to the daemon "
                             f"(it sees {len(self.uuid_to_ordinal)} GPUs)")
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
            rings = [StagingRing(self.cp, "gather", copier, streams[0], streams[1], slots, slot_bytes,
                                 pieces),
                     StagingRing(self.cp, "scatter", copier, streams[2], streams[3], slots, slot_bytes,
                                 pieces)]
        return _Device(ordinal, copier, streams, rings[0], rings[1])

    def _register_arena(self) -> None:
        if self.registered:
            return
        size = self.arena.nbytes
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and soft < size:
            log.warning("RLIMIT_MEMLOCK (%d bytes) is below the host tier (%d bytes); pinning may "
                        "fail: raise LimitMEMLOCK / ulimit -l", soft, size)
        t0 = time.monotonic()
        for start in range(0, size, REGISTER_PIECE):
            piece = min(REGISTER_PIECE, size - start)
            self.rt.hostRegister(self.arena_ptr + start, piece, 0x3)  # Portable | Mapped
        self.registered = True
        if self.rt.pointerGetAttributes(self.arena_ptr).devicePointer != self.arena_ptr:
            raise RuntimeError("this GPU cannot use host pointers of registered memory (no UVA)")
        log.info("host tier pinned for the GPU in %.2f s (%d pieces)", time.monotonic() - t0,
                 -(-size // REGISTER_PIECE))

    # ---- pools --------------------------------------------------------------

    def open_pool(self, buffers: list[dict], layout: LayoutDescriptor, events=(),
                  owner_uid: int | None = None) -> CudaPool:  # IPC handles name no file: no owner
        uuids = {b.get("device_uuid") for b in buffers}
        if {b["kind"] for b in buffers} != {"cuda_ipc"} or len(uuids) != 1:
            raise BadRequest("a CUDA pool's buffers must all be cuda_ipc buffers of one GPU")
        dev = self._device(uuids.pop())
        ptrs, opened = [], []
        with self.cp.cuda.Device(dev.ordinal):
            try:
                for i, b in enumerate(buffers):
                    base = self.rt.ipcOpenMemHandle(b["handle"], _IPC_LAZY_PEER)
                    opened.append(base)
                    if b["offset"] + b["size"] > cuda_driver.allocation_size(base):
                        raise BadRequest(f"buffers[{i}]: offset + size exceed the shared allocation")
                    ptrs.append(base + b["offset"])
                layout.validate_extent([b["size"] for b in buffers])
                store_events = [self.rt.ipcOpenEventHandle(h) for h in events]
                load_events = [[self.rt.eventCreateWithFlags(_EVENT_FLAGS) for _ in range(layout.num_layers)]
                               for _ in range(LOAD_SLOTS)]
            except ValueError as exc:
                self._close_ptrs(opened)
                raise BadRequest(f"layout does not fit its buffers: {exc}") from None
            except BadRequest:
                self._close_ptrs(opened)
                raise
            except Exception as exc:
                self._close_ptrs(opened)
                raise BadRequest(f"cannot open the CUDA IPC handles: {exc}") from None
        handles = [[bytes(self.rt.ipcGetEventHandle(e)) for e in slot] for slot in load_events]
        return CudaPool(dev, opened, plane_bases(layout, ptrs), store_events, load_events, handles)

    def _close_ptrs(self, ptrs) -> None:
        for p in ptrs:
            self.rt.ipcCloseMemHandle(p)

    def close_pool(self, pool: CudaPool) -> None:
        with self.cp.cuda.Device(pool.device.ordinal):
            for stream in pool.device.streams:
                stream.synchronize()
            self._close_ptrs(pool.ptrs)
            for ev in pool.store_events:
                self.rt.eventDestroy(ev)
            for slot in pool.load_events:
                for ev in slot:
                    self.rt.eventDestroy(ev)
        pool.closed = True

    # ---- copies -------------------------------------------------------------

    def _chunk_ptrs(self, plan: CopyPlan) -> np.ndarray:
        return np.asarray(plan.shard_offsets, dtype=np.uint64) + np.uint64(self.arena_ptr)

    @staticmethod
    def _geometry(plan: CopyPlan) -> dict:
        return {**desc_params(plan.layout), "chunk_tokens": plan.chunk_tokens}

    def gather(self, plan: CopyPlan) -> asyncio.Future:
        t0 = time.perf_counter()
        pool, dev = plan.pool, plan.pool.device
        wait = None
        if plan.wait_event is not None:
            if not 0 <= plan.wait_event < len(pool.store_events):
                raise BadRequest(f"event {plan.wait_event} is not one of the registered events")
            wait = pool.store_events[plan.wait_event]
        ptrs, geometry = self._chunk_ptrs(plan), self._geometry(plan)
        layers = range(plan.layout.num_layers)
        with self.cp.cuda.Device(dev.ordinal):
            if (pieces := _plan(dev.store, plan, layers, False)) is not None:
                how = f"{len(pieces)} staged pieces"
                stream = dev.store.run(pieces, pool.bases, plan.page_ids, ptrs, geometry,
                                       wait_event=wait)
            else:
                stream, how = dev.streams[0], "zero-copy kernel"
                if wait is not None:
                    self.rt.streamWaitEvent(stream.ptr, wait, 0)
                dev.copier.gather(pool.bases, plan.page_ids, ptrs, stream=stream, **geometry)
            return self._completion(stream, "gather", plan, how, t0)

    def scatter(self, plan: CopyPlan) -> asyncio.Future:
        t0 = time.perf_counter()
        pool, dev = plan.pool, plan.pool.device
        layers = plan.layers or range(plan.layout.num_layers)
        events = None
        if plan.layerwise:
            slot = pool.next_slot
            pool.next_slot = (slot + 1) % LOAD_SLOTS
            plan.event_slot = slot
            events = pool.load_events[slot]
        ptrs, geometry = self._chunk_ptrs(plan), self._geometry(plan)
        with self.cp.cuda.Device(dev.ordinal):
            if not len(ptrs):  # everything came another way (kvd.cuda.gds): events and completion only
                stream, how = dev.streams[2], "no host chunks"
                for layer in (layers if events is not None else ()):
                    self.rt.eventRecord(events[layer], stream.ptr)
            elif (pieces := _plan(dev.load, plan, layers, plan.layerwise)) is not None:
                how = f"{len(pieces)} staged pieces"
                stream = dev.load.run(pieces, pool.bases, plan.page_ids, ptrs, geometry,
                                      layer_events=events)
            else:
                stream, how = dev.streams[2], "zero-copy kernels"
                with dev.copier.batch("scatter", pool.bases, plan.page_ids, ptrs, stream=stream,
                                      **geometry) as batch:
                    if events is None:
                        batch.launch_all(layers.start, layers.stop)
                    else:
                        for layer in layers:
                            batch.launch_all(layer, layer + 1)
                            self.rt.eventRecord(events[layer], stream.ptr)
            return self._completion(stream, "scatter", plan, how, t0)

    def scatter_device(self, pool: CudaPool, layout: LayoutDescriptor, page_ids, ptrs: list,
                       chunk_tokens: int):
        """Queue kernels scattering whole chunks already in this GPU's memory at ``ptrs``
        into ``page_ids``, on the load kernel stream (returned): a later ``scatter`` of
        this pool is ordered after them, events and completion included."""
        dev = pool.device
        geometry = {**desc_params(layout), "chunk_tokens": chunk_tokens}
        with self.cp.cuda.Device(dev.ordinal):
            dev.copier.scatter(pool.bases, page_ids, ptrs, stream=dev.streams[2], **geometry)
        return dev.streams[2]

    def _completion(self, stream, what: str, plan: CopyPlan, how: str, t0: float) -> asyncio.Future:
        done = self.cp.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        enqueued = time.perf_counter()
        future = self.poller.wait(done)
        if log.isEnabledFor(logging.DEBUG):
            nbytes = len(plan.shard_offsets) * plan.layout.shard_bytes(plan.chunk_tokens)

            def landed(_) -> None:
                took = time.perf_counter() - t0
                log.debug("%s of %d chunks, %.1f MB, %s: enqueued in %.3f ms, landed after "
                          "%.3f ms (%.1f GB/s)", what, len(plan.shard_offsets), nbytes / 1e6, how,
                          (enqueued - t0) * 1e3, took * 1e3, nbytes / took / 1e9)
            future.add_done_callback(landed)
        return future

    def close(self) -> None:
        for dev in self.devices.values():
            with self.cp.cuda.Device(dev.ordinal):
                for stream in dev.streams:
                    stream.synchronize()
                for ring in (dev.store, dev.load):
                    if ring is not None:
                        ring.close()
        if self.registered:
            for start in range(0, self.arena.nbytes, REGISTER_PIECE):
                self.rt.hostUnregister(self.arena_ptr + start)


def _plan(ring: StagingRing | None, plan: CopyPlan, layers: range, per_layer: bool):
    """The ring's pieces for this copy, or None (no ring, or a layer too large for a slot)."""
    if ring is None:
        return None
    layer_bytes = plan.layout.planes * plan.chunk_tokens * plan.layout.row_bytes
    return ring.plan(len(plan.shard_offsets), layers.start, layers.stop, layer_bytes, per_layer)
