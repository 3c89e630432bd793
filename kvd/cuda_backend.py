"""CUDA copy backend: engine KV pools opened through CUDA IPC, copies by kernels.

A pool buffer is ``{kind: "cuda_ipc", handle, offset, size, device_uuid}``:
the daemon maps the UUID to its own device ordinal (engines usually run
with CUDA_VISIBLE_DEVICES), opens the handle once on that device, checks
that ``offset + size`` lies inside the opened allocation, and closes it in
``close_pool`` (called only after the pool's copies completed). A CUDA
context, a stream and the compiled kernels exist only on devices some
client registered memory on. The host arena is registered with the driver
as pinned (portable, in pieces) on first use; kernels read and write it
through unified addressing.

Ordering: a store may name one of the client's interprocess events; the
daemon's stream waits on it before gathering. A scatter records one
interprocess event per layer (a ring of ``LOAD_SLOTS`` sets per pool), so
the engine's stream can wait for layer i while later layers still copy.
Completion of every copy is a blocking-sync event waited on by a helper
thread, which resolves the asyncio future.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import cuda_driver
from .copy_engine import CopyPlan
from .cuda_kernels import KernelCopier, desc_params, plane_bases
from .errors import BadRequest
from .layout import LayoutDescriptor

log = logging.getLogger("kvd")
LOAD_SLOTS = 4
REGISTER_PIECE = 1 << 30
_EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess
_IPC_LAZY_PEER = 1        # cudaIpcMemLazyEnablePeerAccess


@dataclass
class _Device:
    ordinal: int
    copier: KernelCopier
    gather_stream: object   # stores and loads on their own streams, so both
    scatter_stream: object  # directions of PCIe can be busy at once


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

    def __init__(self, arena: np.ndarray, max_blocks: int = 32):
        import cupy
        self.cp = cupy
        self.rt = cupy.cuda.runtime
        self.arena = arena
        self.arena_ptr = arena.ctypes.data
        self.max_blocks = max_blocks
        self.devices: dict[int, _Device] = {}
        self.registered = False
        self.waiter = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvd-cuda-wait")
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
                dev = _Device(ordinal, KernelCopier(ordinal, max_blocks=self.max_blocks),
                              self.cp.cuda.Stream(non_blocking=True), self.cp.cuda.Stream(non_blocking=True))
            self.devices[ordinal] = dev
            log.info("GPU %d (%s): kernels compiled, stream ready", ordinal, uuid)
        return dev

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

    def open_pool(self, buffers: list[dict], layout: LayoutDescriptor, events=()) -> CudaPool:
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
            pool.device.gather_stream.synchronize()
            pool.device.scatter_stream.synchronize()
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

    def gather(self, plan: CopyPlan) -> asyncio.Future:
        pool, dev = plan.pool, plan.pool.device
        with self.cp.cuda.Device(dev.ordinal):
            if plan.wait_event is not None:
                if not 0 <= plan.wait_event < len(pool.store_events):
                    raise BadRequest(f"event {plan.wait_event} is not one of the registered events")
                self.rt.streamWaitEvent(dev.gather_stream.ptr, pool.store_events[plan.wait_event], 0)
            dev.copier.gather(pool.bases, plan.page_ids, self._chunk_ptrs(plan), chunk_tokens=plan.chunk_tokens,
                              stream=dev.gather_stream, **desc_params(plan.layout))
            return self._completion(dev.gather_stream)

    def scatter(self, plan: CopyPlan) -> asyncio.Future:
        pool, dev = plan.pool, plan.pool.device
        layers = plan.layers or range(plan.layout.num_layers)
        slot = pool.next_slot
        pool.next_slot = (slot + 1) % LOAD_SLOTS
        plan.event_slot = slot
        ptrs = self._chunk_ptrs(plan)
        with self.cp.cuda.Device(dev.ordinal):
            for layer in layers:
                dev.copier.scatter(pool.bases, plan.page_ids, ptrs, chunk_tokens=plan.chunk_tokens,
                                   stream=dev.scatter_stream, layer_begin=layer, layer_end=layer + 1,
                                   **desc_params(plan.layout))
                self.rt.eventRecord(pool.load_events[slot][layer], dev.scatter_stream.ptr)
            return self._completion(dev.scatter_stream)

    def _completion(self, stream) -> asyncio.Future:
        done = self.cp.cuda.Event(block=True, disable_timing=True)
        done.record(stream)
        return asyncio.get_running_loop().run_in_executor(self.waiter, done.synchronize)

    def close(self) -> None:
        self.waiter.shutdown(wait=True)
        for dev in self.devices.values():
            dev.gather_stream.synchronize()
            dev.scatter_stream.synchronize()
        if self.registered:
            for start in range(0, self.arena.nbytes, REGISTER_PIECE):
                self.rt.hostUnregister(self.arena_ptr + start)
