"""SharedHostPool: SGLang's own host pool moved into a file kvd maps, so pages cross no staging copy.

SGLang's host pool is an anonymous shared mapping no other process can open.
``SharedHostPool(pages, chunk_tokens, shm_dir, group)`` maps a ``shm_dir`` file over the
very same addresses piece by piece (``MAP_FIXED``; memory never holds the pool twice), so
every tensor and pointer SGLang took stays valid; the CUDA pin is dropped and redone.
``ValueError`` (pool untouched) when it cannot apply; ``OSError``/``RuntimeError`` when the
move fails midway (memory still whole and pinned). ``descriptor``/``buffers`` are what the
daemon registers, ``kvd_pages(slot)`` the ids of a page; ``close()`` unlinks the file.
"""

from __future__ import annotations

import ctypes
import mmap
import os

from kvd_protocol.layout import LayoutDescriptor

from .. import shm

PIECE_BYTES = 1 << 30
_ANON_SHARED = ("/dev/zero (deleted)", "/anon_hugepage (deleted)", "[anon_shmem]")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]


class SharedHostPool:
    def __init__(self, pages, chunk_tokens: int, shm_dir: str = "/dev/shm", group: int | None = None):
        pool = pages.pool
        self.page_size, self.chunk_tokens = pages.page_size, chunk_tokens
        self.kv_dtype, self.attention = pages.kv_dtype, pages.attention
        self.num_layers, self.kv_heads, self.head_dim = pages.num_layers, pages.kv_heads, pages.head_dim
        self.descriptor = host_descriptor(pages, chunk_tokens)
        buffer = getattr(pool, "kv_buffer", None)
        if not hasattr(buffer, "data_ptr"):
            raise ValueError("kvd: SGLang's host pool is not one buffer")
        addr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        length = anonymous_mapping(addr, nbytes)
        free = os.statvfs(shm_dir)
        if free.f_bavail * free.f_frsize < length + (64 << 20):
            raise ValueError(f"kvd: {shm_dir} has no room for the host pool ({length} bytes)")
        self._file = shm.ShmFile.create("kvd-sglang-host", length, shm_dir, group, allocate=False)
        try:
            _move(addr, length, self._file.fileno(), _holds_pages(pool), _pinned(pool))
        except BaseException:
            self.close()
            raise
        self.path, self.size = self._file.path, length
        self.buffers = [{"kind": "shm", "path": str(self.path), "size": length}]

    def kvd_pages(self, slot: int) -> range:
        first = slot // self.chunk_tokens
        return range(first, first + self.page_size // self.chunk_tokens)

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None


def host_descriptor(pages, chunk_tokens: int) -> LayoutDescriptor:
    """kvd's layout of SGLang's host pool in place: pages of ``chunk_tokens`` tokens."""
    pool, c, size = pages.pool, chunk_tokens, pages.pool.size
    if pages.page_size % c:
        raise ValueError(f"kvd: the daemon's chunk_tokens ({c}) must divide SGLang's page size "
                         f"({pages.page_size})")
    layers, planes, P = pages.num_layers, pages.planes, pages.page_size
    item = pages.dtype.itemsize
    row, heads, head_stride = pages.kv_heads * pages.head_dim * item, 1, 0
    per_plane = size * layers * row  # bytes of K (or the latent) in every layout
    layout = pages.layout
    if layout in ("page_first_direct", "page_head") and c != P:
        raise ValueError(f"kvd: the {layout} host layout is shared in place only with "
                         f"chunk_tokens ({c}) equal to SGLang's page size ({P})")
    if layout == "layer_first":
        token, page = row, c * row
        base = [p * per_plane + layer * size * row for layer in range(layers) for p in range(planes)]
    elif layout == "page_first":
        token, page = layers * row, c * layers * row
        base = [p * per_plane + layer * row for layer in range(layers) for p in range(planes)]
    elif layout == "page_first_direct":
        token, page = row, layers * P * row
        base = [p * per_plane + layer * P * row for layer in range(layers) for p in range(planes)]
    elif layout == "page_head":
        piece = pages.head_dim * item
        token, page = layers * piece, pages.kv_heads * P * layers * piece
        heads, head_stride = pages.kv_heads, P * layers * piece
        base = [p * per_plane + layer * piece for layer in range(layers) for p in range(planes)]
    else:
        raise ValueError(f"kvd: the host layout {layout!r} cannot be shared in place")
    return LayoutDescriptor(layers, planes, size // c, c, row, page, token,
                            tuple((0, b) for b in base), heads, head_stride)


def anonymous_mapping(addr: int, nbytes: int) -> int:
    """Length of the anonymous shared mapping that starts at ``addr`` and holds ``nbytes``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start != addr:
                continue
            name = fields[5].strip() if len(fields) > 5 else ""
            if "s" not in fields[1] or name not in _ANON_SHARED or end - start < nbytes:
                break
            return end - start
    raise ValueError("kvd: SGLang's host pool is not an anonymous shared mapping of its own "
                     "(an allocator other than SGLang's mmap one)")


def _holds_pages(pool) -> bool:
    available = getattr(pool, "available_size", None)
    return available is None or available() < pool.size


def _pinned(pool) -> bool:
    if not getattr(pool, "pin_memory", False):
        return False
    import torch
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _move(addr: int, length: int, fd: int, copy: bool, pinned: bool) -> None:
    """The file ``fd`` under ``[addr, addr + length)``, piece by piece, the bytes kept if ``copy``."""
    if pinned:
        _cuda("cudaHostUnregister", addr)
    try:
        for off in range(0, length, PIECE_BYTES):
            n = min(PIECE_BYTES, length - off)
            os.posix_fallocate(fd, off, n)
            if copy:
                _write_all(fd, memoryview((ctypes.c_uint8 * n).from_address(addr + off)).cast("B"), off)
            got = _libc.mmap(addr + off, n, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_SHARED | 0x10, fd, off)  # 0x10: MAP_FIXED
            if got != addr + off:
                err = ctypes.get_errno()
                raise OSError(err, f"kvd: mapping the host pool's file failed: {os.strerror(err)}")
    finally:
        if pinned:
            _cuda("cudaHostRegister", addr, length, 0)


def _write_all(fd: int, data: memoryview, off: int) -> None:
    while data:
        done = os.pwrite(fd, data, off)
        data, off = data[done:], off + done


def _cuda(call: str, *args) -> None:
    import torch
    rc = int(getattr(torch.cuda.cudart(), call)(*args))
    if rc != 0:
        raise RuntimeError(f"kvd: {call} of SGLang's host pool failed (CUDA error {rc})")
