"""SharedKVPool: an engine KV pool in a shared-memory file (host backend).

Allocates, in one file under /dev/shm, the tensors of one of the layouts of
``kvd_protocol.layout`` (numpy arrays, zero-filled), and exposes what
``KvdClient.register_kv`` needs: the layout descriptor, the buffer list,
the dtype and head geometry. The daemon maps the same file and copies
pages in and out. The file is unlinked by ``close`` (and at exit).

Leftovers of processes that died without ``close`` are removed when a new
pool is created, safely across containers that share one /dev/shm
(Docker ``--ipc=host``) and so cannot see each other's pids: every pool
holds an exclusive ``flock`` on its file for its whole life, and another
process's file is removed only when that lock can be taken (its owner is
gone, whatever its pid namespace) and, for files of clients that predate
the lock, the pid in its name is not alive here. A new file is created,
locked, then checked to still be linked under its name (a cleaner may have
taken it in between: then another name is tried).
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import re
from pathlib import Path

import numpy as np

from kvd_protocol import layout as L
from kvd_protocol.keys import DTYPE_SIZES

STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
           "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8, "int8": np.int8, "uint8": np.uint8}
ALIGN = 256


def _shapes(layout: str, n_layers: int, pages: int, ps: int, heads: int, dim: int) -> list:
    per_layer = {"vllm_flash_attn": [(2, pages, ps, heads, dim)],
                 "vllm_flashinfer": [(pages, 2, ps, heads, dim)],
                 "vllm_mla": [(pages, ps, dim)],
                 "sglang_mha": [(pages * ps, heads, dim)] * 2,
                 "sglang_mla": [(pages * ps, 1, dim)]}
    if layout == "page_first":
        return [(pages, n_layers, 2, ps, heads, dim)]
    if layout not in per_layer:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(L.LAYOUTS)}")
    return per_layer[layout] * n_layers


class SharedKVPool:
    def __init__(self, layout: str, num_layers: int, num_pages: int, page_size: int,
                 kv_heads: int, head_dim: int, dtype: str = "float16", shm_dir: str = "/dev/shm"):
        if dtype not in STORAGE:
            raise ValueError(f"dtype must be one of {sorted(STORAGE)}")
        self.layout_name, self.kv_dtype = layout, dtype
        self.attention = "mla" if layout.endswith("mla") else "mha"
        if self.attention == "mla" and kv_heads != 1:
            raise ValueError("MLA pools have kv_heads == 1")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        shapes = _shapes(layout, num_layers, num_pages, page_size, kv_heads, head_dim)
        item = DTYPE_SIZES[dtype]
        offsets, size = [], 0
        for shape in shapes:
            offsets.append(size)
            size += -(-int(np.prod(shape)) * item // ALIGN) * ALIGN
        _remove_dead_pools(Path(shm_dir))
        self.path, self._lock_fd = _create_locked(Path(shm_dir))
        try:
            os.posix_fallocate(self._lock_fd, 0, size)
            self._map = mmap.mmap(self._lock_fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            self.path.unlink(missing_ok=True)
            os.close(self._lock_fd)
            raise
        atexit.register(self.close)
        self.size = size
        self.raw = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [self.raw[o:o + int(np.prod(s)) * item].view(STORAGE[dtype]).reshape(s)
                        for o, s in zip(offsets, shapes)]
        refs = [L.TensorRef(0, o, s, t.strides, item) for o, s, t in zip(offsets, shapes, self.tensors)]
        self.descriptor = L.describe(layout, refs, page_size)
        self.buffers = [{"kind": "shm", "path": str(self.path), "size": size}]

    def close(self) -> None:
        if getattr(self, "_map", None) is None:
            return
        self.tensors, self.raw = [], None
        try:
            self._map.close()
        except BufferError:
            pass  # caller still holds a tensor; the mapping goes when it is collected
        self._map = None
        self.path.unlink(missing_ok=True)
        os.close(self._lock_fd)  # unlinked first: no cleaner can find the file unlocked


def _create_locked(shm_dir: Path) -> tuple[Path, int]:
    """A new pool file under ``shm_dir``, flocked by us and still linked under its name."""
    while True:
        path = shm_dir / f"kvd-pool-{os.getpid()}-{os.urandom(6).hex()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a cleaner holds it for a moment at most
        if _same_file(path, fd):
            return path, fd
        os.close(fd)  # a cleaner took it between our create and our lock


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _remove_dead_pools(shm_dir: Path) -> None:
    for p in shm_dir.glob("kvd-pool-*-*"):
        m = re.fullmatch(r"kvd-pool-(\d+)-[0-9a-f]+", p.name)
        if m and not _alive(int(m.group(1))):
            _remove_if_unlocked(p)


def _remove_if_unlocked(path: Path) -> None:
    """Unlink ``path`` when nobody holds its lock (its owner is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return  # vanished, a symlink, not ours to open: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)  # a live pool, maybe in another pid namespace
        return
    try:
        if _same_file(path, fd):
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
