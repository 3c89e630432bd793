"""CUDA virtual-memory allocations shared by POSIX file descriptor (ctypes on libcuda).

Memory from ``cuMemCreate`` + ``cuMemMap`` has no legacy IPC handle, but each allocation
created exportable can be sent as a file descriptor. Engine side: ``is_vmm``,
``mapped_pieces(ptr, nbytes)``, ``export_fd(base)``. Daemon side: ``map_fds(fds, sizes,
ordinal)`` imports and maps them side by side in one reserved range (same offsets, same
bytes), checking granularity, device and sizes; any failing step undoes the earlier ones.
The caller keeps and closes ``fds``. ``VmmMapping.close`` unmaps and frees. Errors are
``CudaExportError``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .cuda_driver import (
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    CudaExportError,
    device_uuid,
    pointer_attribute,
)
from .cuda_driver import check_status as _check
from .cuda_driver import driver_lib as _cuda

HANDLE_TYPE_POSIX_FD = 1           # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
ATTR_POSIX_FD_SUPPORTED = 103      # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
ALLOCATION_PINNED, LOCATION_DEVICE, PROT_READWRITE = 1, 1, 3
MAX_PIECES = 4096                  # mappings of one tensor: far beyond any allocator's


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@dataclass(frozen=True)
class Piece:
    base: int
    size: int


def is_vmm(ptr: int) -> bool:
    """Whether the device memory at ``ptr`` has no legacy IPC handle (virtual-memory mapped)."""
    return not pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ctypes.c_int)


def address_range(ptr: int) -> Piece:
    """The mapping ``ptr`` lies in (for virtual memory: one physical allocation's mapping)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(_cuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                           ctypes.c_uint64(ptr)), "cuMemGetAddressRange")
    return Piece(base.value, size.value)


def mapped_pieces(ptr: int, nbytes: int) -> list[Piece]:
    """The mappings covering ``[ptr, ptr + nbytes)``, in address order, with no gap."""
    pieces, addr, end = [], ptr, ptr + max(nbytes, 1)
    while addr < end:
        piece = address_range(addr)
        if not piece.base <= addr < piece.base + piece.size:
            raise CudaExportError(f"the driver's range for 0x{addr:x} does not contain it")
        pieces.append(piece)
        addr = piece.base + piece.size
        if len(pieces) > MAX_PIECES:
            raise CudaExportError(f"a KV tensor spans more than {MAX_PIECES} allocations")
    return pieces


def export_fd(base: int) -> int:
    """A new file descriptor for the allocation mapped at ``base`` (the caller closes it)."""
    lib = _cuda()
    handle = ctypes.c_uint64()
    _check(lib.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(base)),
           "cuMemRetainAllocationHandle")
    try:
        fd = ctypes.c_int(-1)
        status = lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle,
                                                  ctypes.c_int(HANDLE_TYPE_POSIX_FD),
                                                  ctypes.c_ulonglong(0))
        if status != 0:
            raise CudaExportError(
                f"cuMemExportToShareableHandle failed with CUDA driver error {status}: this KV "
                "memory was not created with POSIX file-descriptor export (vLLM 0.34 requests it "
                "when the connector declares EXPORTS_FD; PyTorch's expandable segments do not)")
    finally:
        lib.cuMemRelease(handle)  # the retain's reference; the mapping keeps its own
    return fd.value


def fd_export_supported(ordinal: int) -> bool:
    """Whether device ``ordinal`` can import and export allocations as file descriptors."""
    lib = _cuda()
    dev, flag = ctypes.c_int(), ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    return (lib.cuDeviceGetAttribute(ctypes.byref(flag), ATTR_POSIX_FD_SUPPORTED, dev) == 0
            and bool(flag.value))


def granularity(ordinal: int) -> int:
    prop = _device_prop(ordinal)
    out = ctypes.c_size_t()
    _check(_cuda().cuMemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(prop),
                                                 ctypes.c_int(0)), "cuMemGetAllocationGranularity")
    return out.value


def _device_prop(ordinal: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type, prop.requestedHandleTypes = ALLOCATION_PINNED, HANDLE_TYPE_POSIX_FD
    prop.location.type, prop.location.id = LOCATION_DEVICE, ordinal
    return prop


@dataclass
class VmmMapping:
    """Imported allocations mapped side by side at ``base`` (``size`` bytes in all)."""

    base: int
    size: int
    handles: list
    mapped: list  # (address, size) of each mapping made

    def close(self) -> None:
        lib = _cuda()
        for addr, size in self.mapped:
            lib.cuMemUnmap(ctypes.c_uint64(addr), ctypes.c_size_t(size))
        for handle in self.handles:
            lib.cuMemRelease(ctypes.c_uint64(handle))
        if self.base:
            lib.cuMemAddressFree(ctypes.c_uint64(self.base), ctypes.c_size_t(self.size))
        self.mapped, self.handles, self.base = [], [], 0


def map_fds(fds: list[int], sizes: list[int], ordinal: int) -> VmmMapping:
    """Import ``fds`` (allocations of ``sizes`` bytes on device ``ordinal``) and map them
    side by side; the caller keeps and closes ``fds``."""
    if not fds or len(fds) != len(sizes):
        raise CudaExportError(f"{len(fds)} file descriptors for {len(sizes)} pieces")
    grain = granularity(ordinal)
    for i, size in enumerate(sizes):
        if size <= 0 or size % grain:
            raise CudaExportError(f"piece {i}: {size} bytes is not a multiple of the GPU's "
                                  f"allocation granularity ({grain} bytes)")
    lib = _cuda()
    out = VmmMapping(0, sum(sizes), [], [])
    try:
        for i, fd in enumerate(fds):
            out.handles.append(_import(lib, fd, i, ordinal))
        _map_side_by_side(lib, out, sizes, grain, ordinal)
    except BaseException:
        out.close()
        raise
    return out


def allocate(sizes: list[int], ordinal: int) -> VmmMapping:
    """The engine's side, as vLLM 0.34's extensible KV cache allocates: device memory of
    ``sizes`` bytes each (multiples of ``granularity``), created exportable as file
    descriptors, mapped side by side in one reserved range (for tests and the bench)."""
    lib, prop = _cuda(), _device_prop(ordinal)
    out = VmmMapping(0, sum(sizes), [], [])
    try:
        for size in sizes:
            handle = ctypes.c_uint64()
            _check(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                                   ctypes.c_ulonglong(0)), "cuMemCreate")
            out.handles.append(handle.value)
        _map_side_by_side(lib, out, sizes, granularity(ordinal), ordinal)
    except BaseException:
        out.close()
        raise
    return out


def _map_side_by_side(lib, out: VmmMapping, sizes: list[int], grain: int, ordinal: int) -> None:
    base = ctypes.c_uint64()
    _check(lib.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(out.size),
                                   ctypes.c_size_t(grain), ctypes.c_uint64(0),
                                   ctypes.c_ulonglong(0)), "cuMemAddressReserve")
    out.base = addr = base.value
    for i, (handle, size) in enumerate(zip(out.handles, sizes)):
        status = lib.cuMemMap(ctypes.c_uint64(addr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                              ctypes.c_uint64(handle), ctypes.c_ulonglong(0))
        if status != 0:
            raise CudaExportError(f"piece {i}: mapping {size} bytes failed (CUDA driver "
                                  f"error {status}): the allocation is smaller")
        out.mapped.append((addr, size))
        addr += size
    desc = _AccessDesc(_Location(LOCATION_DEVICE, ordinal), PROT_READWRITE)
    _check(lib.cuMemSetAccess(ctypes.c_uint64(out.base), ctypes.c_size_t(out.size),
                              ctypes.byref(desc), ctypes.c_size_t(1)), "cuMemSetAccess")


def _import(lib, fd: int, i: int, ordinal: int) -> int:
    handle = ctypes.c_uint64()
    status = lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                ctypes.c_int(HANDLE_TYPE_POSIX_FD))
    if status != 0:
        raise CudaExportError(f"piece {i}: the file descriptor is not a CUDA allocation this "
                              f"process can import (CUDA driver error {status})")
    prop = _AllocationProp()
    status = lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), handle)
    where = (prop.location.type, prop.location.id)
    if status != 0 or where[0] != LOCATION_DEVICE or not _same_gpu(where[1], ordinal):
        lib.cuMemRelease(handle)
        raise CudaExportError(f"piece {i}: the allocation is not on the registering GPU "
                              f"(location {where}, expected device {ordinal})")
    return handle.value


def _same_gpu(ordinal: int, expected: int) -> bool:
    if ordinal == expected:
        return True
    try:
        return device_uuid(ordinal) == device_uuid(expected)
    except CudaExportError:
        return False
