"""The CUDA backend's devices and pools: set-up, pinning, opening, closing.

A pool buffer is ``cuda_ipc`` (the daemon maps the device UUID to its ordinal, opens the
handle once, checks ``offset + size`` lies inside the allocation) or ``cuda_vmm`` (virtual
memory lent by file descriptor, mapped by kvd.cuda.buffers); ``close_pool`` closes or
unmaps it, only after the pool's copies completed. Contexts, streams, kernels and staging
rings exist only on devices a client registered memory on; the host arena is pinned
(portable, in pieces) on first use. ``CudaDevices`` holds them; ``CudaCopyEngine``
(kvd/cuda/backend.py) queues the copies. ``close`` gives queued copies at most
``CLOSE_WAIT_S`` before the process exits anyway.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

import numpy as np

from kvd.copy.flags import FlagPage
from kvd.copy.poll import EventPoller
from kvd.cuda import buffers as buffers_mod
from kvd.cuda.dma import path as dma
from kvd.cuda.dma.plan import pool_groups
from kvd.cuda.dma.staging import StagingRing
from kvd.cuda.kernels import KernelCopier, plane_bases
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
class GpuDevice:
    ordinal: int
    copier: KernelCopier
    streams: list              # [store kernels, store DMA, load kernels, load DMA]: stores and
    store: StagingRing | None  # loads have their own streams and slots, so both directions
    load: StagingRing | None   # of PCIe can be busy at once
    dma: dma.DmaPath | None = None


@dataclass
class CudaPool:
    device: GpuDevice
    ptrs: list
    bases: np.ndarray
    flags: FlagPage
    by_dma: bool = False
    groups: list | None = None  # kvd.cuda.dma.plan.pool_groups, with by_dma
    closed: bool = False


class CudaDevices:
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
        self.devices: dict[int, GpuDevice] = {}
        self.registered = False
        # 0: re-check copies every loop pass; > 0: sleep that long after checks that found none
        self.poller = EventPoller(0.0, poll_interval_us / 1e6) if poll_interval_us > 0 else EventPoller()
        # the driver's 16 bytes, as the engine's side reads them (kvd_protocol.cuda_driver):
        # the runtime's properties hand the UUID over as a C string, cut at its first 0 byte
        self.uuid_to_ordinal = {cuda_driver.device_uuid(i): i
                                for i in range(self.rt.getDeviceCount())}

    # ---- set-up -------------------------------------------------------------

    def _device(self, uuid: str) -> GpuDevice:
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

    def _make_device(self, ordinal: int) -> GpuDevice:
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
        return GpuDevice(ordinal, copier, streams, rings[0], rings[1], path)

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

    def _drain(self, dev: GpuDevice, deadline: float) -> bool:
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
