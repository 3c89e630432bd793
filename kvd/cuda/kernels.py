"""SM copy kernels between an engine's paged KV pool and canonical chunk bytes.

Contract:

- ``KernelCopier(device_id)`` compiles ``kernels/kv_copy.cu`` with
  ``cupy.RawModule`` once, at construction; nothing on the request path
  compiles. CuPy is imported lazily: importing this module never needs it,
  constructing a ``KernelCopier`` without it raises ``RuntimeError``.
- ``gather`` copies pool rows into canonical chunk shards, ``scatter`` the
  other way. Canonical bytes of one shard are ``[layer][plane][token][row]``
  for all ``num_layers`` layers (``kvd_protocol.layout``); a layer subrange
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
- Head-strided rows (``heads > 1``, kvd_protocol.layout): the kernels copy
  each token row as ``heads`` pieces of ``row_bytes // heads`` bytes,
  ``head_stride`` apart in the pool, back to back in the shard.
- Bytes only: any dtype. The host picks 16-byte accesses when the piece
  size, the three strides and every base and chunk pointer are 16-aligned,
  else the widest of 8, 4, 2, 1 bytes that fits.
- The grid is capped at ``max_blocks`` blocks of ``threads`` threads
  (grid-stride loop), so a copy leaves the engine the rest of the SMs.
- ``batch(kind, ...)`` validates one request and uploads its small tables
  (bases, page ids, chunk pointers) once; the returned ``CopyBatch``
  launches any number of kernels over them (chunk and layer subranges, a
  chunk-pointer table indexed apart from the page ids: ``kvd.cuda.dma.staging``
  points each piece at a staging slot). ``gather``/``scatter`` are one
  batch with one launch.
- Tables travel in one host-to-device copy from a pinned staging slot, on a
  side stream that the copy's stream then waits for (an event), so
  back-to-back copies on one stream have no table upload between their
  kernels. ``slots`` slots are reused round-robin; ``busy_slot()`` is the
  event to await (from the event loop, kvd.copy.poll) before the next
  ``batch`` when that slot's last batch has not finished: the daemon never
  blocks its loop on the GPU. (A direct caller that did not wait blocks in
  ``batch`` until the slot is free.)
- ``cancel=(address, seq)`` makes every kernel of the batch skip its copy
  when the 32-bit word at ``address`` (a load's cancel word in a host-mapped
  flag page, kvd_protocol.flags) equals ``seq`` as the kernel starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

KERNEL_FILE = "kv_copy.cu"
_MAX_ROWS = 2**31 - 1          # pieces per launch (the kernel indexes them in 32 bits)
_H2D = 1                       # cudaMemcpyHostToDevice


def kernel_source_path(name: str = KERNEL_FILE) -> Path:
    """The kernel source: ``kvd/kernels/`` (package data), repo-root ``kernels/``,
    or wherever the ``kvd.kernels`` package maps to (editable installs)."""
    package = Path(__file__).resolve().parent.parent  # kvd/
    for candidate in (package / "kernels" / name, package.parent / "kernels" / name):
        if candidate.is_file():
            return candidate
    try:
        from importlib.resources import files
        candidate = Path(str(files("kvd.kernels").joinpath(name)))
        if candidate.is_file():
            return candidate
    except Exception:  # noqa: BLE001 - no such package: fall through to the error
        pass
    raise RuntimeError(f"{name} not found in {package / 'kernels'} or {package.parent / 'kernels'}")


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError("kvd.cuda.kernels needs CuPy (cupy-cuda12x/13x) and a CUDA GPU") from exc
    return cupy


def vector_bytes(row_bytes: int, page_stride: int, token_stride: int,
                 plane_bases: np.ndarray, chunk_ptrs: np.ndarray, heads: int = 1,
                 head_stride: int = 0) -> int:
    """The widest access (16, 8, 4, 2 or 1 bytes) that every piece address allows."""
    acc = int(row_bytes) // int(heads) | int(page_stride) | int(token_stride) | int(head_stride)
    if plane_bases.size:
        acc |= int(np.bitwise_or.reduce(plane_bases))
    if chunk_ptrs.size:
        acc |= int(np.bitwise_or.reduce(chunk_ptrs))
    for width in (16, 8, 4, 2):
        if acc % width == 0:
            return width
    return 1


def group_threads(piece_bytes: int, vec: int) -> int:
    """Threads that share one piece: the kernel's rule, repeated for grid sizing."""
    vecs, g = piece_bytes // vec, 1
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
            "row_bytes": desc.row_bytes, "heads": desc.heads, "head_stride": desc.head_stride,
            "num_pages": desc.num_pages}


def copy_params(desc: Any, chunk_tokens: int) -> dict[str, int]:
    """``desc_params`` and a copy's ``chunk_tokens``: the keyword arguments of a copy."""
    return {**desc_params(desc), "chunk_tokens": chunk_tokens}


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
               chunk_ptrs: Sequence[int], *, stream: Any = None, layer_begin: int = 0,
               layer_end: int | None = None, **geometry: Any) -> None:
        """Pool pages -> canonical shards at ``chunk_ptrs`` (asynchronous on ``stream``).
        ``geometry``: ``num_layers, planes, chunk_tokens, page_size, page_stride,
        token_stride, row_bytes`` and optionally ``heads, head_stride, num_pages`` (see
        ``desc_params``)."""
        with self.batch("gather", plane_bases, page_ids, chunk_ptrs, stream=stream, **geometry) as b:
            b.launch_all(layer_begin, layer_end)

    def scatter(self, plane_bases: Sequence[int], page_ids: Sequence[int],
                chunk_ptrs: Sequence[int], *, stream: Any = None, layer_begin: int = 0,
                layer_end: int | None = None, **geometry: Any) -> None:
        """Canonical shards at ``chunk_ptrs`` -> pool pages (asynchronous on ``stream``)."""
        with self.batch("scatter", plane_bases, page_ids, chunk_ptrs, stream=stream, **geometry) as b:
            b.launch_all(layer_begin, layer_end)

    def batch(self, kind: str, plane_bases: Sequence[int], page_ids: Sequence[int],
              chunk_ptrs: Sequence[int], *, num_layers: int, planes: int, chunk_tokens: int,
              page_size: int, page_stride: int, token_stride: int, row_bytes: int,
              heads: int = 1, head_stride: int = 0, stream: Any = None,
              num_pages: int | None = None,
              cancel: tuple[int, int] | None = None) -> "CopyBatch":
        """Validate and upload the tables of one request once; launch its kernels
        through the returned ``CopyBatch`` (a context manager: leaving it marks the
        tables' slot free once the launched kernels are done)."""
        if kind not in ("gather", "scatter"):
            raise ValueError("kind must be gather or scatter")
        bases = np.ascontiguousarray(plane_bases, dtype=np.uint64).reshape(-1)
        pids = np.ascontiguousarray(page_ids, dtype=np.int64).reshape(-1)
        ptrs = np.ascontiguousarray(chunk_ptrs, dtype=np.uint64).reshape(-1)
        if num_layers < 1 or planes not in (1, 2):
            raise ValueError("num_layers must be >= 1 and planes 1 or 2")
        if bases.size != num_layers * planes:
            raise ValueError(f"expected {num_layers * planes} plane bases, got {bases.size}")
        if chunk_tokens < 1 or page_size < 1 or chunk_tokens % page_size:
            raise ValueError("chunk_tokens must be a positive multiple of page_size")
        if row_bytes < 1 or page_stride < 0 or token_stride < 0 or head_stride < 0:
            raise ValueError("row_bytes must be >= 1 and strides >= 0")
        if heads < 1 or row_bytes % heads:
            raise ValueError(f"heads ({heads}) must be >= 1 and divide row_bytes ({row_bytes})")
        ppc = chunk_tokens // page_size
        if pids.size % ppc:
            raise ValueError(f"{pids.size} page ids are not whole chunks of {ppc} pages")
        if pids.size and (int(pids.min()) < 0 if num_pages is None  # one pass: -1 wraps high
                          else int(pids.view(np.uint64).max()) >= num_pages):
            raise ValueError("page id out of range")
        vec = vector_bytes(row_bytes, page_stride, token_stride, bases, ptrs, heads, head_stride)
        cp = self._cp
        if stream is None:
            stream = cp.cuda.get_current_stream()
        with cp.cuda.Device(self.device_id):
            slot = self._upload(stream, bases, pids, ptrs)
        return CopyBatch(self, self._kernels[kind], slot, stream, bases.size, pids.size,
                         ptrs.size, (num_layers, planes, chunk_tokens, page_size, page_stride,
                                     token_stride, row_bytes, heads, head_stride, vec),
                         cancel or (0, 0))

    def busy_slot(self) -> Any:
        """The event the next ``batch`` would have to wait for, or None when its table
        slot is free."""
        event = self._slots[self._next].event
        return None if event is None or event.done else event

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


class CopyBatch:
    """Kernels of one request over one uploaded table (``KernelCopier.batch``);
    launch inside its ``with`` block (which makes the copier's device current).

    ``launch(first, count, layer_begin, layer_end, ptr_first)`` copies chunks
    ``[first, first + count)`` of the page-id table, layers ``[layer_begin,
    layer_end)``, chunk ``first + k`` going to (or coming from)
    ``chunk_ptrs[ptr_first + k]`` (``ptr_first`` defaults to ``first``).
    """

    def __init__(self, copier: KernelCopier, kernel: Any, slot: _Slot, stream: Any,
                 n_bases: int, n_pids: int, n_ptrs: int, geometry: tuple,
                 cancel: tuple[int, int] = (0, 0)) -> None:
        self.copier, self.kernel, self.slot, self.stream = copier, kernel, slot, stream
        self.geometry = geometry
        self.ppc = geometry[2] // geometry[3]
        self.n_chunks, self.n_ptrs = n_pids // self.ppc, n_ptrs
        table = int(slot.dev.ptr)
        self._pids = table + 8 * n_bases
        self._ptrs = table + 8 * (n_bases + n_pids)
        (num_layers, planes, tokens, page_size, page_stride, token_stride, row_bytes, heads,
         head_stride, vec) = geometry
        self.heads = heads
        self._head = (np.uint64(table),)
        self._tail = (np.int32(tokens), np.int32(page_size), np.int64(page_stride),
                      np.int64(token_stride), np.int64(row_bytes), np.int32(heads),
                      np.int64(head_stride), np.int32(vec), np.uint64(cancel[0]),
                      np.uint32(cancel[1]))
        self.group = group_threads(row_bytes // heads, vec)
        self._device = copier._cp.cuda.Device(copier.device_id)

    def __enter__(self) -> "CopyBatch":
        self._device.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.slot.event.record(self.stream)
            if self.copier.debug_sync:
                self.stream.synchronize()
        finally:
            self._device.__exit__(*exc)

    def launch_all(self, layer_begin: int = 0, layer_end: int | None = None) -> None:
        """Every chunk, ``chunk_ptrs`` one per chunk, split where one launch would
        index too many rows."""
        num_layers, planes, tokens = self.geometry[:3]
        layer_end = num_layers if layer_end is None else layer_end
        if self.n_ptrs != self.n_chunks:
            raise ValueError(f"expected {self.n_chunks} chunk pointers, got {self.n_ptrs}")
        if not 0 <= layer_begin <= layer_end <= num_layers:
            raise ValueError(f"bad layer range [{layer_begin}, {layer_end}) of {num_layers}")
        rows_per_chunk = (layer_end - layer_begin) * planes * tokens * self.heads
        if rows_per_chunk == 0:
            return
        per_launch = _MAX_ROWS // rows_per_chunk
        if per_launch == 0:
            raise ValueError("one chunk has too many rows for one launch")
        for first in range(0, self.n_chunks, per_launch):
            self.launch(first, min(self.n_chunks - first, per_launch), layer_begin, layer_end)

    def launch(self, first: int, count: int, layer_begin: int, layer_end: int,
               ptr_first: int | None = None) -> None:
        num_layers, planes, tokens = self.geometry[:3]
        vec = self.geometry[-1]
        ptr_first = first if ptr_first is None else ptr_first
        if not 0 <= layer_begin <= layer_end <= num_layers:
            raise ValueError(f"bad layer range [{layer_begin}, {layer_end}) of {num_layers}")
        if first < 0 or count < 0 or first + count > self.n_chunks \
                or ptr_first < 0 or ptr_first + count > self.n_ptrs:
            raise ValueError("chunk range outside the uploaded tables")
        rows = count * (layer_end - layer_begin) * planes * tokens * self.heads
        if rows == 0:
            return
        if rows > _MAX_ROWS:
            raise ValueError("too many rows for one launch")
        cop = self.copier
        blocks = max(1, min(cop.max_blocks, -(-rows * self.group // cop.threads)))
        cop.last_plan = {"vec_bytes": vec, "group": self.group, "blocks": blocks,
                         "threads": cop.threads, "rows": rows}
        args = (*self._head, np.uint64(self._pids + 8 * first * self.ppc),
                np.uint64(self._ptrs + 8 * ptr_first), np.int32(count), np.int32(num_layers),
                np.int32(planes), np.int32(layer_begin), np.int32(layer_end), *self._tail)
        try:
            self.kernel((blocks,), (cop.threads,), args, stream=self.stream)
        except Exception as exc:
            raise RuntimeError(f"copy kernel launch failed: {exc}") from exc
