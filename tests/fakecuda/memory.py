"""The fake GPU's address space: which addresses "the GPU" may touch, and the bytes there.

Every address the fake hands out or accepts is a real address of this
process, so kvd's pointer arithmetic (plane bases, chunk pointers, slot
pointers, flag words) runs unchanged; but the fake touches memory only
through ``resolve``, which finds the live ``Region`` holding the whole
range and raises ``CudaError(ILLEGAL_ADDRESS)`` otherwise, as a GPU faults
on an address nothing maps. Regions:

- ``device``: ``alloc(size)`` (cudaMalloc). A memfd named
  ``fakecuda-<pid>-<serial>``, mapped here; the device pointer is the
  mapping's address. ``ipc_handle(ptr)`` names the allocation in 64 bytes
  (magic, pid, fd, size, serial) as cudaIpcGetMemHandle does.
- ``ipc``: ``ipc_open(handle)`` in another process maps
  ``/proc/<pid>/fd/<fd>``: the same pages, as CUDA IPC maps the same device
  memory (the exporter must be alive to open, as with CUDA; the mapping
  outlives it). Opening a handle already open returns the same address and
  counts references; opening one's own handle fails, as with CUDA.
  ``ipc_close`` drops the region at the last reference: a later access by
  queued work is an illegal address.
- ``host``: ``host_register(ptr, size)`` (cudaHostRegister with the mapped
  flag: under unified addressing the host address is the device address).
  Ranges may not overlap another registration; unregistering takes the
  exact base. Only registered host memory is reachable by kernels, DMA and
  stream memory operations: an unregistered host pointer is an illegal
  address (stricter than CUDA's pageable memcpy, which kvd never uses).
- ``pinned``: ``alloc_pinned(size)`` (cudaHostAlloc), anonymous memory that
  lives until the process exits.
- ``vmm``: CUDA virtual memory (``vmm_create``, ``vmm_reserve``, ``vmm_map``; file
  descriptors by ``vmm_export`` and ``vmm_import``), see below.

Region names are the same in every process (see fakecuda.trace).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import mmap
import os
import struct
import threading
from dataclasses import dataclass, field

import numpy as np

from . import trace
from .errors import (
    HOST_MEMORY_ALREADY_REGISTERED,
    HOST_MEMORY_NOT_REGISTERED,
    ILLEGAL_ADDRESS,
    INVALID_VALUE,
    CudaError,
)

HANDLE_MAGIC = b"FAKECUDA"
HANDLE_BYTES = 64
_HANDLE = struct.Struct("<8sqqqqq")  # magic, pid, fd, size, serial, device


@dataclass(eq=False)
class Region:
    base: int
    size: int
    kind: str                 # device | ipc | host | pinned
    name: str
    array: np.ndarray         # uint8 over [base, base + size)
    device: int = 0
    owner: object = None      # the mmap (device, ipc, pinned) or None (host: the caller's)
    fd: int = -1              # device: the memfd other processes open
    serial: int = 0
    refs: int = 1             # ipc: opens of the same handle
    key: tuple = field(default=())


class AddressSpace:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bases: list[int] = []
        self._regions: list[Region] = []
        self._ipc: dict[tuple, Region] = {}
        self._serial = itertools.count(1)

    # ---- lookup -------------------------------------------------------------

    def find(self, addr: int) -> Region | None:
        with self._lock:
            i = bisect.bisect_right(self._bases, addr) - 1
            if i >= 0:
                r = self._regions[i]
                if addr < r.base + r.size:
                    return r
        return None

    def resolve(self, addr: int, nbytes: int, kinds: tuple = (), what: str = "access") -> tuple[Region, int]:
        """The region holding ``[addr, addr + nbytes)`` and the offset in it."""
        r = self.find(int(addr))
        if r is not None and r.kind == "vmm" and int(addr) + int(nbytes) > r.base + r.size:
            r = self._vmm_run(r, int(addr) + int(nbytes))
        if r is None or int(addr) + int(nbytes) > r.base + r.size or nbytes < 0:
            raise CudaError(ILLEGAL_ADDRESS, f"{what} of {nbytes} bytes at {int(addr):#x}: "
                                             "no live allocation or registration holds it")
        if kinds and r.kind not in kinds:
            raise CudaError(INVALID_VALUE, f"{what} at {int(addr):#x}: {r.kind} memory "
                                           f"({r.name}), expected {'/'.join(kinds)}")
        return r, int(addr) - r.base

    def view(self, addr: int, nbytes: int, kinds: tuple = (), what: str = "access") -> np.ndarray:
        r, off = self.resolve(addr, nbytes, kinds, what)
        return r.array[off:off + nbytes]

    def _add(self, r: Region) -> Region:
        with self._lock:
            i = bisect.bisect_right(self._bases, r.base)
            before = self._regions[i - 1] if i else None
            after = self._regions[i] if i < len(self._regions) else None
            if (before and before.base + before.size > r.base) or \
                    (after and r.base + r.size > after.base):
                raise CudaError(HOST_MEMORY_ALREADY_REGISTERED,
                                f"[{r.base:#x}, +{r.size}) overlaps {(before or after).name}")
            self._bases.insert(i, r.base)
            self._regions.insert(i, r)
        return r

    def _drop(self, r: Region) -> None:
        with self._lock:
            i = self._regions.index(r)
            del self._bases[i], self._regions[i]

    # ---- device memory and IPC ---------------------------------------------

    def alloc(self, size: int, device: int = 0) -> Region:
        if size < 1:
            raise CudaError(INVALID_VALUE, "alloc of 0 bytes")
        serial = next(self._serial)
        fd = os.memfd_create(f"fakecuda-{os.getpid()}-{serial}")
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        arr = np.frombuffer(mm, dtype=np.uint8)
        return self._add(Region(arr.ctypes.data, size, "device", f"{os.getpid()}:{serial}", arr,
                                device, mm, fd, serial))

    def free(self, ptr: int) -> None:
        r = self.find(ptr)
        if r is None or r.kind != "device" or r.base != ptr:
            raise CudaError(INVALID_VALUE, f"free of {ptr:#x}: not an allocation's base")
        self._drop(r)
        os.close(r.fd)
        _close(r)

    def ipc_handle(self, ptr: int) -> bytes:
        r = self.find(ptr)
        if r is None or r.kind != "device":
            raise CudaError(INVALID_VALUE, f"{ptr:#x} is not device memory of this process")
        raw = _HANDLE.pack(HANDLE_MAGIC, os.getpid(), r.fd, r.size, r.serial, r.device)
        return raw.ljust(HANDLE_BYTES, b"\0")

    def ipc_open(self, handle: bytes) -> int:
        handle = bytes(handle)
        if len(handle) != HANDLE_BYTES or not handle.startswith(HANDLE_MAGIC):
            raise CudaError(INVALID_VALUE, "not an IPC handle of the fake GPU")
        _, pid, fd, size, serial, device = _HANDLE.unpack_from(handle)
        if pid == os.getpid():
            raise CudaError(INVALID_VALUE, "a process cannot open its own IPC handle")
        key = (pid, serial)
        with self._lock:
            r = self._ipc.get(key)
            if r is not None:
                r.refs += 1
                return r.base
        try:
            mfd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError as exc:
            raise CudaError(INVALID_VALUE, f"cannot open the IPC handle: {exc}") from None
        try:
            if os.fstat(mfd).st_size != size:
                raise CudaError(INVALID_VALUE, "the IPC handle names another allocation")
            mm = mmap.mmap(mfd, size)
        finally:
            os.close(mfd)
        arr = np.frombuffer(mm, dtype=np.uint8)
        r = self._add(Region(arr.ctypes.data, size, "ipc", f"{pid}:{serial}", arr, device, mm,
                             key=key))
        with self._lock:
            self._ipc[key] = r
        trace.emit("ipc_open", region=r.name)
        return r.base

    def ipc_close(self, ptr: int) -> None:
        r = self.find(ptr)
        if r is None or r.kind != "ipc" or r.base != ptr:
            raise CudaError(INVALID_VALUE, f"{ptr:#x} is not an opened IPC allocation")
        with self._lock:
            r.refs -= 1
            last = r.refs == 0
            if last:
                del self._ipc[r.key]
        if last:
            self._drop(r)
            _close(r)
            trace.emit("ipc_close", region=r.name)

    # ---- virtual memory: cuMemCreate, cuMemMap, file descriptors ------------
    # A physical allocation (a handle) is a memfd named fakecuda-vmm-<pid>-<serial>;
    # exporting dups it, importing checks the name and dups it; mapping maps it at a fixed
    # address inside a reserved (PROT_NONE) range, as a region of kind "vmm" whose key is
    # (reservation base, handle). Mappings side by side in one reservation are one
    # contiguous range to copies, as on a GPU (``_vmm_run``).

    def vmm_create(self, size: int, device: int) -> int:
        serial = next(self._serial)
        fd = os.memfd_create(f"fakecuda-vmm-{os.getpid()}-{serial}")
        os.ftruncate(fd, size)
        return self._new_handle(fd, size, device)

    def _new_handle(self, fd: int, size: int, device: int) -> int:
        with self._lock:
            self._handle_ids = getattr(self, "_handle_ids", itertools.count(0x4A00))
            self._handles = getattr(self, "_handles", {})
            handle = next(self._handle_ids)
            self._handles[handle] = [fd, size, device, 1]
        return handle

    def vmm_handle(self, handle: int) -> list:
        entry = getattr(self, "_handles", {}).get(handle)
        if entry is None:
            raise CudaError(INVALID_VALUE, f"no allocation handle {handle:#x}")
        return entry

    def vmm_retain(self, addr: int) -> int:
        r = self.find(addr)
        if r is None or r.kind != "vmm":
            raise CudaError(INVALID_VALUE, f"{addr:#x} is not mapped virtual memory")
        with self._lock:
            self.vmm_handle(r.key[1])[3] += 1
        return r.key[1]

    def vmm_release(self, handle: int) -> None:
        entry = self.vmm_handle(handle)
        with self._lock:
            entry[3] -= 1
            if entry[3] == 0:
                del self._handles[handle]
                os.close(entry[0])  # a mapping keeps the pages (its own reference)

    def vmm_export(self, handle: int) -> int:
        return os.dup(self.vmm_handle(handle)[0])

    def vmm_import(self, fd: int) -> int:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            raise CudaError(INVALID_VALUE, f"fd {fd} is not open") from None
        if not name.startswith("/memfd:fakecuda-vmm-"):
            raise CudaError(INVALID_VALUE, f"fd {fd} ({name}) is no allocation of the fake GPU")
        return self._new_handle(os.dup(fd), os.fstat(fd).st_size, 0)

    def vmm_reserve(self, size: int) -> int:
        addr = _LIBC.mmap(None, size, 0, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr in (None, _MAP_FAILED):
            raise CudaError(INVALID_VALUE, "cannot reserve address space")
        with self._lock:
            self._reserved = getattr(self, "_reserved", {})
            self._reserved[addr] = size
        return addr

    def vmm_map(self, addr: int, size: int, handle: int) -> None:
        fd, hsize, device, _ = self.vmm_handle(handle)
        base = next((b for b, n in getattr(self, "_reserved", {}).items()
                     if b <= addr and addr + size <= b + n), None)
        if base is None or size > hsize or size < 1:
            raise CudaError(INVALID_VALUE, f"cuMemMap of {size} bytes at {addr:#x} (allocation "
                                           f"of {hsize}; reserved: {base is not None})")
        got = _LIBC.mmap(addr, size, _PROT_RW, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != addr:
            raise CudaError(INVALID_VALUE, "cuMemMap: mmap failed")
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
        self._add(Region(addr, size, "vmm", f"vmm:{os.getpid()}:{handle:#x}", arr, device,
                         key=(base, handle)))
        with self._lock:
            self.vmm_handle(handle)[3] += 1  # the mapping's reference

    def vmm_unmap(self, addr: int, size: int) -> None:
        gone = [r for r in self.regions("vmm") if addr <= r.base and r.base + r.size <= addr + size]
        if not gone:
            raise CudaError(INVALID_VALUE, f"nothing mapped at {addr:#x}")
        for r in gone:
            self._drop(r)
            _LIBC.mmap(r.base, r.size, 0, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
            self.vmm_release(r.key[1])

    def vmm_free(self, addr: int, size: int) -> None:
        with self._lock:
            if getattr(self, "_reserved", {}).get(addr) != size:
                raise CudaError(INVALID_VALUE, f"no reservation of {size} bytes at {addr:#x}")
            del self._reserved[addr]
        if any(addr <= r.base < addr + size for r in self.regions("vmm")):
            raise CudaError(INVALID_VALUE, "cuMemAddressFree of a range still mapped")
        _LIBC.munmap(addr, size)

    def _vmm_run(self, r: Region, end: int) -> Region:
        """``r`` and the mappings after it in its reservation, as one region up to ``end``."""
        stop = r.base + r.size
        while stop < end:
            nxt = self.find(stop)
            if nxt is None or nxt.kind != "vmm" or nxt.key[0] != r.key[0]:
                return r  # a gap: the caller faults
            stop = nxt.base + nxt.size
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * (stop - r.base)).from_address(r.base))
        return Region(r.base, stop - r.base, "vmm", r.name, arr, r.device, key=r.key)

    # ---- host memory --------------------------------------------------------

    def host_register(self, ptr: int, size: int) -> None:
        if size < 1 or not ptr:
            raise CudaError(INVALID_VALUE, "hostRegister of an empty range")
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))
        self._add(Region(ptr, size, "host", _mapped_file(ptr) or f"host:{ptr:#x}", arr))

    def host_unregister(self, ptr: int) -> None:
        r = self.find(ptr)
        if r is None or r.kind != "host" or r.base != ptr:
            raise CudaError(HOST_MEMORY_NOT_REGISTERED, f"{ptr:#x} is not a registered base")
        self._drop(r)

    def alloc_pinned(self, size: int) -> Region:
        mm = mmap.mmap(-1, max(1, size))
        arr = np.frombuffer(mm, dtype=np.uint8)
        return self._add(Region(arr.ctypes.data, size, "pinned", f"pinned:{next(self._serial)}",
                                arr, owner=mm))

    def regions(self, kind: str | None = None) -> list[Region]:
        with self._lock:
            return [r for r in self._regions if kind is None or r.kind == kind]


def _close(r: Region) -> None:
    r.array = np.zeros(0, np.uint8)
    try:
        r.owner.close()
    except BufferError:  # a view is still out there: the mapping goes when it does
        pass


def _mapped_file(ptr: int) -> str | None:
    """The base name of the file mapped at ``ptr`` (/proc/self/maps), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= ptr < hi and len(parts) == 6 and parts[5].startswith("/"):
                    return os.path.basename(parts[5].strip().removesuffix(" (deleted)"))
    except OSError:
        pass
    return None


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_RW, _MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED = 0x3, 0x01, 0x02, 0x10
_MAP_ANONYMOUS, _MAP_NORESERVE = 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

SPACE = AddressSpace()
