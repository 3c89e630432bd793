"""SM copy kernels between an engine's paged KV pool and canonical chunk bytes.

Contract:

- ``KernelCopier(device_id)`` compiles ``kernels/kv_copy.cu`` with
  ``cupy.RawModule`` once, at construction; nothing on the request path
  compiles. CuPy is imported lazily: importing this module never needs it,
  constructing a ``KernelCopier`` without it raises ``RuntimeError``.
- ``gather`` copies pool rows into canonical chunk shards, ``scatter`` the
  other way. Canonical bytes of one shard are ``[layer][plane][token][row]``
  for all ``num_layers`` layers (``kvd.layout``); a layer subrange
  ``[layer_begin, layer_end)`` copies only those layers, still at their full
  canonical offsets. Chunk ``c``'s token ``i`` lives in page
  ``page_ids[c * ppc + i // page_size]``, slot ``i % page_size``.
- ``plane_bases`` are absolute device addresses, ``num_layers * planes`` of
  them, layer-major. ``chunk_ptrs`` are addresses the GPU can reach: pinned
  host memory under unified addressing (``cudaHostAlloc``, or
  ``cudaHostRegister``-ed memory where the device can use host pointers),
  or device memory. Each shard must hold ``shard_bytes`` bytes.
- Copies are asynchronous on the given CuPy stream (the current stream when
  none is given); the caller waits on that stream before it reads the
  destination. Page ids are checked against ``num_pages`` when given and
  must be >= 0; the pointers are not checked.
- Bytes only: any dtype. The host picks 16-byte accesses when ``row_bytes``,
  both strides and every base and chunk pointer are 16-aligned, else the
  widest of 8, 4, 2, 1 bytes that fits.
- The grid is capped at ``max_blocks`` blocks of ``threads`` threads
  (grid-stride loop), so a copy leaves the engine the rest of the SMs.
- The small tables (bases, page ids, chunk pointers) travel in one
  host-to-device copy from a pinned staging slot, on a side stream that the
  copy's stream then waits for (an event), so back-to-back copies on one
  stream have no table upload between their kernels. ``slots`` slots are
  reused round-robin; reusing one first waits (host side) until the copy
  that last used it has finished.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

KERNEL_FILE = "kv_copy.cu"
_MAX_ROWS = 2**31 - 1          # rows per launch (the kernel indexes rows in 32 bits)
_H2D = 1                       # cudaMemcpyHostToDevice


def kernel_source_path() -> Path:
    """The kernel source: ``kvd/kernels/`` (package data), repo-root ``kernels/``,
    or wherever the ``kvd.kernels`` package maps to (editable installs)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels" / KERNEL_FILE, here.parent / "kernels" / KERNEL_FILE):
        if candidate.is_file():
            return candidate
    try:
        from importlib.resources import files
        candidate = Path(str(files("kvd.kernels").joinpath(KERNEL_FILE)))
        if candidate.is_file():
            return candidate
    except Exception:  # noqa: BLE001 - no such package: fall through to the error
        pass
    raise RuntimeError(f"{KERNEL_FILE} not found in {here / 'kernels'} or {here.parent / 'kernels'}")


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError("kvd.cuda_kernels needs CuPy (cupy-cuda12x/13x) and a CUDA GPU") from exc
    return cupy


def vector_bytes(row_bytes: int, page_stride: int, token_stride: int,
                 plane_bases: np.ndarray, chunk_ptrs: np.ndarray) -> int:
    """The widest access (16, 8, 4, 2 or 1 bytes) that every row address allows."""
    acc = int(row_bytes) | int(page_stride) | int(token_stride)
    if plane_bases.size:
        acc |= int(np.bitwise_or.reduce(plane_bases))
    if chunk_ptrs.size:
        acc |= int(np.bitwise_or.reduce(chunk_ptrs))
    for width in (16, 8, 4, 2):
        if acc % width == 0:
            return width
    return 1


def group_threads(row_bytes: int, vec: int) -> int:
    """Threads that share one row: the kernel's rule, repeated for grid sizing."""
    vecs, g = row_bytes // vec, 1
    while g < vecs and g < 32:
        g <<= 1
    return g


def plane_bases(desc: Any, buffer_ptrs: Sequence[int]) -> np.ndarray:
    """Absolute plane base addresses (uint64) of a ``LayoutDescriptor`` over device
    buffers; compute once per registration and pass the same array to every call."""
    return np.array([int(buffer_ptrs[buf]) + int(off) for buf, off in desc.bases], np.uint64)


def desc_params(desc: Any) -> dict[str, int]:
    """The keyword arguments of ``gather``/``scatter`` a ``LayoutDescriptor`` fixes."""
    return {"num_layers": desc.num_layers, "planes": desc.planes, "page_size": desc.page_size,
            "page_stride": desc.page_stride, "token_stride": desc.token_stride,
            "row_bytes": desc.row_bytes, "num_pages": desc.num_pages}


class _Slot:
    """One pinned staging table, its device twin and the event of its last use."""

    def __init__(self) -> None:
        self.words = 0
        self.host: np.ndarray | None = None
        self.dev: Any = None
        self.event: Any = None      # recorded after the kernel that read this slot
        self.ready: Any = None      # recorded after this slot's table upload
        self._pinned: Any = None


class KernelCopier:
    """Gather/scatter between a paged KV pool and canonical chunk shards on one GPU."""

    def __init__(self, device_id: int = 0, max_blocks: int = 16, threads: int = 512,
                 slots: int = 16, debug_sync: bool = False,
                 compile_options: Sequence[str] = ()) -> None:
        cp = _import_cupy()
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        if threads < 32 or threads > 1024 or threads % 32:
            raise ValueError("threads must be a multiple of 32 in [32, 1024]")
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self._cp = cp
        self.device_id = int(device_id)
        self.max_blocks = int(max_blocks)
        self.threads = int(threads)
        self.debug_sync = debug_sync
        self.last_plan: dict[str, int] = {}
        source = kernel_source_path().read_text()
        with cp.cuda.Device(self.device_id):
            try:
                self._module = cp.RawModule(code=source, options=("--std=c++14", *compile_options))
                self._kernels = {"gather": self._module.get_function("kv_gather"),
                                 "scatter": self._module.get_function("kv_scatter")}
            except Exception as exc:
                raise RuntimeError(f"compiling {KERNEL_FILE} failed: {exc}") from exc
            self.sm_count = int(cp.cuda.Device(self.device_id).attributes["MultiProcessorCount"])
            self._upload_stream = cp.cuda.Stream(non_blocking=True)
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0

    def gather(self, plane_bases: Sequence[int], page_ids: Sequence[int],
               chunk_ptrs: Sequence[int], *, num_layers: int, planes: int,
               chunk_tokens: int, page_size: int, page_stride: int, token_stride: int,
               row_bytes: int, stream: Any = None, layer_begin: int = 0,
               layer_end: int | None = None, num_pages: int | None = None) -> None:
        """Pool pages -> canonical shards at ``chunk_ptrs`` (asynchronous on ``stream``)."""
        self._copy("gather", plane_bases, page_ids, chunk_ptrs, num_layers, planes,
                   chunk_tokens, page_size, page_stride, token_stride, row_bytes, stream,
                   layer_begin, layer_end, num_pages)

    def scatter(self, plane_bases: Sequence[int], page_ids: Sequence[int],
                chunk_ptrs: Sequence[int], *, num_layers: int, planes: int,
                chunk_tokens: int, page_size: int, page_stride: int, token_stride: int,
                row_bytes: int, stream: Any = None, layer_begin: int = 0,
                layer_end: int | None = None, num_pages: int | None = None) -> None:
        """Canonical shards at ``chunk_ptrs`` -> pool pages (asynchronous on ``stream``)."""
        self._copy("scatter", plane_bases, page_ids, chunk_ptrs, num_layers, planes,
                   chunk_tokens, page_size, page_stride, token_stride, row_bytes, stream,
                   layer_begin, layer_end, num_pages)

    def _copy(self, kind: str, bases_in: Sequence[int], pids_in: Sequence[int],
              ptrs_in: Sequence[int], num_layers: int, planes: int, chunk_tokens: int,
              page_size: int, page_stride: int, token_stride: int, row_bytes: int,
              stream: Any, layer_begin: int, layer_end: int | None,
              num_pages: int | None) -> None:
        bases = np.ascontiguousarray(bases_in, dtype=np.uint64).reshape(-1)
        pids = np.ascontiguousarray(pids_in, dtype=np.int64).reshape(-1)
        ptrs = np.ascontiguousarray(ptrs_in, dtype=np.uint64).reshape(-1)
        if layer_end is None:
            layer_end = num_layers
        if num_layers < 1 or planes not in (1, 2):
            raise ValueError("num_layers must be >= 1 and planes 1 or 2")
        if bases.size != num_layers * planes:
            raise ValueError(f"expected {num_layers * planes} plane bases, got {bases.size}")
        if chunk_tokens < 1 or page_size < 1 or chunk_tokens % page_size:
            raise ValueError("chunk_tokens must be a positive multiple of page_size")
        if row_bytes < 1 or page_stride < 0 or token_stride < 0:
            raise ValueError("row_bytes must be >= 1 and strides >= 0")
        if not 0 <= layer_begin <= layer_end <= num_layers:
            raise ValueError(f"bad layer range [{layer_begin}, {layer_end}) of {num_layers}")
        ppc = chunk_tokens // page_size
        n_chunks = ptrs.size
        if pids.size != n_chunks * ppc:
            raise ValueError(f"expected {n_chunks * ppc} page ids for {n_chunks} chunks, "
                             f"got {pids.size}")
        if pids.size and (int(pids.min()) < 0 if num_pages is None  # one pass: -1 wraps high
                          else int(pids.view(np.uint64).max()) >= num_pages):
            raise ValueError("page id out of range")
        rows_per_chunk = (layer_end - layer_begin) * planes * chunk_tokens
        if n_chunks == 0 or rows_per_chunk == 0:
            return
        if rows_per_chunk > _MAX_ROWS:
            raise ValueError("one chunk has too many rows for one launch")
        vec = vector_bytes(row_bytes, page_stride, token_stride, bases, ptrs)
        group = group_threads(row_bytes, vec)
        per_launch = _MAX_ROWS // rows_per_chunk
        cp = self._cp
        if stream is None:
            stream = cp.cuda.get_current_stream()
        with cp.cuda.Device(self.device_id):
            for first in range(0, n_chunks, per_launch):
                last = min(n_chunks, first + per_launch)
                rows = (last - first) * rows_per_chunk
                blocks = max(1, min(self.max_blocks, -(-rows * group // self.threads)))
                self.last_plan = {"vec_bytes": vec, "group": group, "blocks": blocks,
                                  "threads": self.threads, "rows": rows}
                slot = self._upload(stream, bases, pids[first * ppc:last * ppc],
                                    ptrs[first:last])
                table = int(slot.dev.ptr)
                args = (np.uint64(table), np.uint64(table + 8 * bases.size),
                        np.uint64(table + 8 * (bases.size + (last - first) * ppc)),
                        np.int32(last - first), np.int32(num_layers), np.int32(planes),
                        np.int32(layer_begin), np.int32(layer_end), np.int32(chunk_tokens),
                        np.int32(page_size), np.int64(page_stride), np.int64(token_stride),
                        np.int64(row_bytes), np.int32(vec))
                try:
                    self._kernels[kind]((blocks,), (self.threads,), args, stream=stream)
                except Exception as exc:
                    raise RuntimeError(f"kv_{kind} launch failed: {exc}") from exc
                slot.event.record(stream)
        if self.debug_sync:
            stream.synchronize()

    def _upload(self, stream: Any, bases: np.ndarray, pids: np.ndarray,
                ptrs: np.ndarray) -> _Slot:
        """Stage the three tables in the next slot and copy them to its device twin."""
        cp = self._cp
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.event is not None:
            slot.event.synchronize()   # its last copy and kernel are done with both buffers
        else:
            slot.event = cp.cuda.Event(block=False, disable_timing=True)
            slot.ready = cp.cuda.Event(block=False, disable_timing=True)
        words = bases.size + pids.size + ptrs.size
        if words > slot.words:
            cap = max(4096, 1 << (words - 1).bit_length())
            slot._pinned = cp.cuda.alloc_pinned_memory(cap * 8)
            slot.host = np.frombuffer(slot._pinned, dtype=np.int64, count=cap)
            slot.dev = cp.cuda.alloc(cap * 8)
            slot.words = cap
        host: np.ndarray = slot.host  # type: ignore[assignment]
        nb, npid = bases.size, pids.size
        host[:nb] = bases.view(np.int64)
        host[nb:nb + npid] = pids
        host[nb + npid:words] = ptrs.view(np.int64)
        up = self._upload_stream
        cp.cuda.runtime.memcpyAsync(slot.dev.ptr, host.ctypes.data, words * 8, _H2D, up.ptr)
        slot.ready.record(up)
        stream.wait_event(slot.ready)
        return slot
