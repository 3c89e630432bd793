"""libcuda of the fake GPU, for ``kvd_protocol.cuda_driver``'s ctypes calls.

``FakeLibcuda`` has the driver functions cuda_driver calls, taking the same
ctypes arguments (``byref`` outputs, ``c_void_p``/``c_uint64`` values) and
returning a ``CUresult`` (0, or the error's code: fakecuda.errors), over
the same address space, devices and streams as the fake runtime. So the
engine side (exporting tensors, registering the flag page, marking its
stream, waiting for layers) and the daemon side (``allocation_size``,
the load's layer and done words) run cuda_driver's real code.

``install()`` makes cuda_driver use it in this process (cuda_driver loads
libcuda once, into its module global ``_lib``; the fake goes there) and
returns a function that puts back what was there. The daemon gets it from
the cupy shim (tests/fakecuda/shim); engines in tests call ``install``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time

import numpy as np

from kvd.cuda.dma.plan import OP_DTYPE

from . import errors, runtime, streams, trace
from .errors import INVALID_VALUE, NOT_READY, CudaError
from .memory import SPACE

ATTR_DEVICE_ORDINAL, ATTR_IPC_CAPABLE, ATTR_RANGE_START, ATTR_RANGE_SIZE = 9, 10, 11, 12
VMM_POSIX_FD_SUPPORTED, VMM_GRANULARITY = 103, 64 << 10  # the fake's granule: small pools
_CONTEXT = 0xC0A7E47
_MAX_3D_ROWS = int(os.environ.get("FAKECUDA_MAX_3D_ROWS", "0") or 0)
_ROW_BATCHES = itertools.count(1)
_FAIL_ROW_BATCH = int(os.environ.get("FAKECUDA_FAIL_ROW_BATCH", "0") or 0)


def _value(arg) -> int:
    v = getattr(arg, "value", arg)
    return 0 if v is None else int(v)


def _out(ref, value: int) -> None:
    ref._obj.value = value


def _status(fn):
    def call(*args):
        try:
            errors.check()
            fn(*args)
        except CudaError as exc:
            return exc.status
        return 0
    call.__name__ = fn.__name__
    return call


class FakeLibcuda:
    @_status
    def cuInit(self, flags):
        pass

    @_status
    def cuDeviceGet(self, dev_ref, ordinal):
        if not 0 <= _value(ordinal) < runtime.device_count():
            raise CudaError(INVALID_VALUE, f"no device {_value(ordinal)}")
        _out(dev_ref, _value(ordinal))

    @_status
    def cuDeviceGetUuid_v2(self, uuid, dev):
        ctypes.memmove(uuid, runtime.device_uuid(_value(dev)), 16)

    @_status
    def cuPointerGetAttribute(self, out_ref, attr, ptr):
        r = SPACE.find(_value(ptr))
        if r is None:
            raise CudaError(INVALID_VALUE, f"{_value(ptr):#x} is no memory the GPU knows")
        attr = _value(attr)
        values = {ATTR_DEVICE_ORDINAL: r.device, ATTR_IPC_CAPABLE: int(r.kind == "device"),
                  ATTR_RANGE_START: r.base, ATTR_RANGE_SIZE: r.size}
        if attr not in values:
            raise CudaError(INVALID_VALUE, f"pointer attribute {attr}")
        _out(out_ref, values[attr])

    @_status
    def cuMemGetAddressRange_v2(self, base_ref, size_ref, ptr):
        r = SPACE.find(_value(ptr))
        if r is None or r.kind not in ("device", "vmm"):
            raise CudaError(INVALID_VALUE, f"{_value(ptr):#x} is no device memory")
        _out(base_ref, r.base)
        _out(size_ref, r.size)

    # ---- virtual memory (fakecuda.memory's vmm_*) ----------------------------

    @_status
    def cuDeviceGetAttribute(self, out_ref, attr, dev):
        _out(out_ref, int(_value(attr) == VMM_POSIX_FD_SUPPORTED))

    @_status
    def cuMemGetAllocationGranularity(self, out_ref, prop_ref, option):
        _out(out_ref, VMM_GRANULARITY)

    @_status
    def cuMemCreate(self, handle_ref, size, prop_ref, flags):
        size = _value(size)
        if size < 1 or size % VMM_GRANULARITY:
            raise CudaError(INVALID_VALUE, f"cuMemCreate of {size} bytes")
        _out(handle_ref, SPACE.vmm_create(size, prop_ref._obj.location.id))

    @_status
    def cuMemRetainAllocationHandle(self, handle_ref, addr):
        _out(handle_ref, SPACE.vmm_retain(_value(addr)))

    @_status
    def cuMemRelease(self, handle):
        SPACE.vmm_release(_value(handle))

    @_status
    def cuMemExportToShareableHandle(self, fd_ref, handle, kind, flags):
        if _value(kind) != 1:
            raise CudaError(INVALID_VALUE, "only POSIX file descriptors")
        _out(fd_ref, SPACE.vmm_export(_value(handle)))

    @_status
    def cuMemImportFromShareableHandle(self, handle_ref, os_handle, kind):
        _out(handle_ref, SPACE.vmm_import(_value(os_handle)))

    @_status
    def cuMemGetAllocationPropertiesFromHandle(self, prop_ref, handle):
        _, _, device, _ = SPACE.vmm_handle(_value(handle))
        prop = prop_ref._obj
        prop.type, prop.requestedHandleTypes = 1, 1
        prop.location.type, prop.location.id = 1, device

    @_status
    def cuMemAddressReserve(self, ptr_ref, size, align, addr, flags):
        _out(ptr_ref, SPACE.vmm_reserve(_value(size)))

    @_status
    def cuMemMap(self, addr, size, offset, handle, flags):
        SPACE.vmm_map(_value(addr), _value(size), _value(handle))

    @_status
    def cuMemSetAccess(self, addr, size, desc_ref, count):
        addr, size = _value(addr), _value(size)
        SPACE.resolve(addr, size, ("vmm",), "cuMemSetAccess")  # all of it mapped

    @_status
    def cuMemUnmap(self, addr, size):
        SPACE.vmm_unmap(_value(addr), _value(size))

    @_status
    def cuMemAddressFree(self, addr, size):
        SPACE.vmm_free(_value(addr), _value(size))

    @_status
    def cuIpcGetMemHandle(self, handle, base):
        raw = SPACE.ipc_handle(_value(base))
        ctypes.memmove(handle, raw, len(raw))

    @_status
    def cuCtxGetCurrent(self, ctx_ref):
        _out(ctx_ref, _CONTEXT)

    @_status
    def cuDevicePrimaryCtxRetain(self, ctx_ref, dev):
        _out(ctx_ref, _CONTEXT)

    @_status
    def cuCtxSetCurrent(self, ctx):
        pass

    @_status
    def cuMemHostRegister_v2(self, ptr, size, flags):
        SPACE.host_register(_value(ptr), _value(size))

    @_status
    def cuMemHostGetDevicePointer_v2(self, out_ref, ptr, flags):
        r = SPACE.find(_value(ptr))
        if r is None or r.kind not in runtime.HOST:
            raise CudaError(INVALID_VALUE, f"{_value(ptr):#x} is not registered host memory")
        _out(out_ref, _value(ptr))

    @_status
    def cuMemHostUnregister(self, ptr):
        SPACE.host_unregister(_value(ptr))

    @_status
    def cuStreamWriteValue32_v2(self, stream, addr, value, flags):
        streams.stream_at(_value(stream)).write_value32(_value(addr), _value(value))

    @_status
    def cuStreamQuery(self, stream):
        if not streams.stream_at(_value(stream)).done:
            raise CudaError(NOT_READY, "work queued on the stream has not run yet")

    @_status
    def cuStreamWaitValue32_v2(self, stream, addr, value, flags):
        if _value(flags) != 0:  # only GEQ, the one cuda_driver uses
            raise CudaError(INVALID_VALUE, f"wait flags {_value(flags)}")
        streams.stream_at(_value(stream)).wait_value32(_value(addr), _value(value))

    @_status
    def cuMemcpyBatchAsync_v2(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream):
        """Copies in stream order, as one piece of queued work: each checked like a
        cudaMemcpyDefault (any live memory, one allocation or registration per side) when
        queued and when run; ``FAKECUDA_KERNEL_DELAY_S``'s ``memcpy_batch`` delays it; the
        trace gets one ``dma`` event naming the regions written and the thread that queued
        it (``queued_by``)."""
        n, st = _value(count), _value(stream)
        if n == 0 or _value(num_attrs) != 1 or st == 0:  # the driver refuses the legacy stream
            raise CudaError(INVALID_VALUE, f"memcpy batch count={n} attrs={_value(num_attrs)} "
                                           f"stream={st:#x}")
        if next(_ROW_BATCHES) == _FAIL_ROW_BATCH:  # the test knob: this one call, once
            raise CudaError(INVALID_VALUE, "memcpy batch (FAKECUDA_FAIL_ROW_BATCH)")
        pieces = [tuple(int(x) for x in (ctypes.c_uint64 * n).from_address(_value(p)))
                  for p in (dsts, srcs, sizes)]
        for d, s, z in zip(*pieces):
            SPACE.resolve(s, z, what="memcpy batch source")
            SPACE.resolve(d, z, what="memcpy batch destination")
        by = threading.current_thread().name
        streams.stream_at(st).enqueue(lambda: _run_rows(*pieces, by=by))

    @_status
    def cuMemcpy3DBatchAsync_v2(self, count, ops, flags, stream):
        """Pitched copies (``kvd.cuda.dma.plan.OP_DTYPE``, pointer operands, depth 1) in
        stream order, as one piece of queued work: each op's whole extent on each side
        must lie in one live allocation or registration when queued and when run;
        ``FAKECUDA_KERNEL_DELAY_S``'s ``memcpy_batch`` delays it; the trace gets one
        ``dma`` event naming the regions written."""
        n, st = _value(count), _value(stream)
        if n == 0 or _value(flags) != 0 or st == 0:  # the driver refuses the legacy stream
            raise CudaError(INVALID_VALUE, f"3D memcpy batch count={n} flags={_value(flags)} "
                                           f"stream={st:#x}")
        raw = (ctypes.c_uint8 * (n * OP_DTYPE.itemsize)).from_address(_value(ops))
        batch = np.frombuffer(bytes(raw), OP_DTYPE)  # the driver reads the list when queued
        for op in batch:  # the real driver answers INVALID_VALUE for an extent over two
            for addr, span, what in _sides(op):  # allocations (seen on an H100)
                try:
                    SPACE.resolve(addr, span, what=what)
                except CudaError as exc:
                    raise CudaError(INVALID_VALUE, str(exc)) from None
        by = threading.current_thread().name
        streams.stream_at(st).enqueue(lambda: _run_batch(batch, by=by))


def _sides(op) -> list[tuple[int, int, str]]:
    """``(address, span, what)`` of an op's source and destination; INVALID_VALUE for
    what the real driver refuses or the fake does not model."""
    w, h = int(op["width"]), int(op["height"])
    if _MAX_3D_ROWS and h > _MAX_3D_ROWS:
        raise CudaError(INVALID_VALUE, f"3D memcpy of {h} rows (FAKECUDA_MAX_3D_ROWS)")
    if (op["src_type"] != 1 or op["dst_type"] != 1 or int(op["depth"]) != 1 or not w or not h
            or op["order"] not in (1, 2, 3)):
        raise CudaError(INVALID_VALUE, f"3D memcpy op {op}")
    out = []
    for side in ("src", "dst"):
        pitch = int(op[f"{side}_pitch"]) or w
        if pitch < w:
            raise CudaError(INVALID_VALUE, f"3D memcpy {side} pitch {pitch} < width {w}")
        out.append((int(op[side]), (h - 1) * pitch + w, f"3D memcpy {side}"))
    return out


def _run_batch(batch, by: str) -> None:
    t0 = time.monotonic()
    delay = streams.kernel_delay("memcpy_batch")
    if delay:
        time.sleep(delay)
    touched = set()
    for op in batch:
        (s, s_span, _), (d, d_span, _) = _sides(op)
        s_reg, s_off = SPACE.resolve(s, s_span, what="3D memcpy source")
        d_reg, d_off = SPACE.resolve(d, d_span, what="3D memcpy destination")
        w = int(op["width"])
        sp, dp = int(op["src_pitch"]) or w, int(op["dst_pitch"]) or w
        for i in range(int(op["height"])):
            d_reg.array[d_off + i * dp:d_off + i * dp + w] = s_reg.array[s_off + i * sp:s_off + i * sp + w]
        touched.add(d_reg.name)
    trace.emit("dma", t0=t0, pieces=len(batch), regions=sorted(touched), queued_by=by)


def _run_rows(dsts, srcs, sizes, by: str) -> None:
    t0 = time.monotonic()
    delay = streams.kernel_delay("memcpy_batch")
    if delay:
        time.sleep(delay)
    touched = set()
    for d, s, z in zip(dsts, srcs, sizes):
        s_reg, s_off = SPACE.resolve(s, z, what="memcpy batch source")
        d_reg, d_off = SPACE.resolve(d, z, what="memcpy batch destination")
        d_reg.array[d_off:d_off + z] = s_reg.array[s_off:s_off + z]
        touched.add(d_reg.name)
    trace.emit("dma", t0=t0, pieces=len(sizes), regions=sorted(touched), queued_by=by)




def install():
    """Point kvd_protocol.cuda_driver at the fake; returns the undo."""
    from kvd_protocol import cuda_driver
    before = cuda_driver._lib
    cuda_driver._lib = FakeLibcuda()

    def restore() -> None:
        cuda_driver._lib = before
    return restore
