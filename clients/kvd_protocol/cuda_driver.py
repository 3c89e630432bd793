"""CUDA driver calls through ctypes, shared by the client and the daemon.

``export_allocation(ptr)`` finds the allocation a device pointer lies in and returns its IPC
handle, base, size and device UUID (the daemon adds the tensor's offset). Virtual-memory
allocations cannot be exported this way: detected up front, ``CudaExportError`` naming the
cause. Only libcuda is needed, no CuPy in the engine. The daemon also queues its
copy-engine batches here (``memcpy3d_batch_async``, kvd.cuda.dma.path).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
IPC_HANDLE_BYTES = 64


class CudaExportError(RuntimeError):
    pass


@dataclass(frozen=True)
class ExportedAllocation:
    handle: bytes
    base: int
    size: int
    device_uuid: str


_lib = None


def _cuda():
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaExportError(f"the CUDA driver (libcuda.so.1) is not available: {exc}") from None
        _check(lib.cuInit(0), "cuInit")
        _lib = lib
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CudaExportError(f"{what} failed with CUDA driver error {status}")


driver_lib, check_status = _cuda, _check  # for kvd_protocol.cuda_vmm


def pointer_attribute(ptr: int, attr: int, ctype) -> int:
    value = ctype()
    _check(_cuda().cuPointerGetAttribute(ctypes.byref(value), attr, ctypes.c_uint64(ptr)),
           f"cuPointerGetAttribute({attr})")
    return value.value


def device_uuid(ordinal: int) -> str:
    lib = _cuda()
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    uuid = (ctypes.c_ubyte * 16)()
    _check(lib.cuDeviceGetUuid_v2(uuid, dev), "cuDeviceGetUuid")
    return bytes(uuid).hex()


def export_allocation(ptr: int) -> ExportedAllocation:
    """The IPC handle of the allocation holding device pointer ``ptr``."""
    if not pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ctypes.c_int):
        raise CudaExportError(
            "this KV buffer cannot be shared through cudaIpcGetMemHandle: it comes from a CUDA "
            "virtual-memory allocator (PyTorch expandable_segments, vLLM sleep mode, kvcached). "
            "Unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or disable sleep mode")
    base = pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ctypes.c_uint64)
    size = pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_RANGE_SIZE, ctypes.c_uint64)
    ordinal = pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_int)
    handle = (ctypes.c_ubyte * IPC_HANDLE_BYTES)()
    _check(_cuda().cuIpcGetMemHandle(handle, ctypes.c_uint64(base)), "cuIpcGetMemHandle")
    return ExportedAllocation(bytes(handle), base, size, device_uuid(ordinal))


def allocation_size(ptr: int) -> int:
    """Bytes of the allocation ``ptr`` lies in, from ``ptr`` to its end."""
    base = pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ctypes.c_uint64)
    return base + pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_RANGE_SIZE, ctypes.c_uint64) - ptr


# ---- host-mapped flag words and stream memory operations ------------------------

CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_MEMHOSTREGISTER_DEVICEMAP = 0x2
CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0


def _fn(name: str, *alternatives: str):
    lib = _cuda()
    for candidate in (name, *alternatives):
        fn = getattr(lib, candidate, None)
        if fn is not None:
            return fn
    raise CudaExportError(f"the CUDA driver has no {name}")


def ensure_context(ordinal: int) -> None:
    """Make the device's primary context current on this thread if none is:
    driver calls need one, and a thread of the engine may not have touched CUDA."""
    lib = _cuda()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        return
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def register_host(ptr: int, size: int, ordinal: int = 0) -> int:
    """Register host memory (page-aligned) as portable and device-mapped; returns
    the address GPUs use for it (the same as ``ptr`` with unified addressing)."""
    ensure_context(ordinal)
    _check(_fn("cuMemHostRegister_v2", "cuMemHostRegister")(
        ctypes.c_void_p(ptr), ctypes.c_size_t(size),
        ctypes.c_uint(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP)),
        "cuMemHostRegister")
    dptr = ctypes.c_uint64()
    _check(_fn("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")(
        ctypes.byref(dptr), ctypes.c_void_p(ptr), ctypes.c_uint(0)), "cuMemHostGetDevicePointer")
    return dptr.value


def unregister_host(ptr: int) -> None:
    _check(_cuda().cuMemHostUnregister(ctypes.c_void_p(ptr)), "cuMemHostUnregister")


def stream_write_u32(stream: int, dev_addr: int, value: int) -> None:
    """Queue on ``stream``: once all earlier work on it is done, write ``value`` to the
    32-bit word at ``dev_addr`` (with a memory barrier: earlier writes are visible first).
    Needs a current context (``ensure_context``)."""
    _check(_fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32")(
        ctypes.c_void_p(stream), ctypes.c_uint64(dev_addr), ctypes.c_uint32(value),
        ctypes.c_uint(CU_STREAM_WRITE_VALUE_DEFAULT)), "cuStreamWriteValue32")


CUDA_ERROR_NOT_READY = 600


def stream_idle(stream: int) -> bool:
    """True when everything queued on ``stream`` so far has run (``cuStreamQuery``).
    Needs a current context (``ensure_context``)."""
    status = _cuda().cuStreamQuery(ctypes.c_void_p(stream))
    if status == CUDA_ERROR_NOT_READY:
        return False
    _check(status, "cuStreamQuery")
    return True


def stream_wait_u32(stream: int, dev_addr: int, value: int) -> None:
    """Queue on ``stream``: later work waits until the word at ``dev_addr`` is at or past
    ``value`` (cyclic 32-bit compare). Whoever can write the word can release the wait."""
    _check(_fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32")(
        ctypes.c_void_p(stream), ctypes.c_uint64(dev_addr), ctypes.c_uint32(value),
        ctypes.c_uint(CU_STREAM_WAIT_VALUE_GEQ)), "cuStreamWaitValue32")


class _MemLoc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes (CUDA 12.8+)
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLoc),
                ("dstLocHint", _MemLoc), ("flags", ctypes.c_uint)]


CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
_STREAM_ORDER = _MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, _MemLoc(0, 0), _MemLoc(0, 0), 0)
_FIRST = ctypes.c_size_t(0)


def memcpy_batch_async(stream: int, dsts, srcs, sizes) -> None:
    """Queue ``len(dsts)`` copies (uint64 numpy arrays of addresses and byte counts) on
    ``stream`` as one batch, in stream order: each is done by the copy engines, with no
    kernel. Any direction; host addresses must be pinned. ``stream`` must not be the
    legacy default stream (the driver refuses it)."""
    n = len(dsts)
    if not n:
        return
    _check(_fn("cuMemcpyBatchAsync_v2")(
        ctypes.c_void_p(dsts.ctypes.data), ctypes.c_void_p(srcs.ctypes.data),
        ctypes.c_void_p(sizes.ctypes.data), ctypes.c_size_t(n), ctypes.byref(_STREAM_ORDER),
        ctypes.byref(_FIRST), ctypes.c_size_t(1), ctypes.c_void_p(stream)), "cuMemcpyBatchAsync")


def has_memcpy3d_batch() -> bool:
    """Whether the driver has ``cuMemcpy3DBatchAsync_v2`` (CUDA 13 drivers)."""
    try:
        _fn("cuMemcpy3DBatchAsync_v2")
    except CudaExportError:
        return False
    return True


def memcpy3d_batch_async(stream: int, ops_addr: int, count: int) -> None:
    """Queue ``count`` pitched copies (an array of ``CUDA_MEMCPY3D_BATCH_OP`` at
    ``ops_addr``, kvd.cuda.dma.plan.OP_DTYPE) on ``stream`` as one batch, in stream
    order: each is done by the copy engines, with no kernel. Any direction; host
    addresses must be pinned. ``stream`` must not be the legacy default stream (the
    driver refuses it)."""
    if count:
        _check(_fn("cuMemcpy3DBatchAsync_v2")(
            ctypes.c_size_t(count), ctypes.c_void_p(ops_addr), ctypes.c_ulonglong(0),
            ctypes.c_void_p(stream)), "cuMemcpy3DBatchAsync")
