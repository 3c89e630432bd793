"""CUDA driver calls through ctypes, shared by the client and the daemon.

Used by the engine side to export KV tensors through CUDA IPC and by the
daemon to check what it opened (the real size of an opened allocation).

``export_allocation(ptr)`` finds the allocation a device pointer lies in
(caching allocators hand out tensors in the middle of larger blocks) and
returns its IPC handle, the allocation base and size, and the device UUID;
the daemon opens the handle once and adds the tensor's byte offset.
Memory from CUDA virtual-memory allocators (PyTorch expandable segments,
vLLM sleep mode) cannot be exported with ``cuIpcGetMemHandle``: that is
detected up front and raised as ``CudaExportError`` naming the cause.
Only libcuda is needed: no cupy in the engine.
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
