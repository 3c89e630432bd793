"""kernels/kv_copy.cu's kv_gather and kv_scatter in numpy, behind a fake ``cupy.RawModule``.

``RawModule(code=...)`` reads the real kernel source kvd compiles and
checks that both kernels still take the parameters this fake implements
(by name, in order): a changed signature fails at start-up instead of being
misread. ``get_function("kv_gather" | "kv_scatter")`` returns a launcher
with CuPy's calling convention, ``kernel(grid, block, args, stream=)``;
any other function raises ``CudaError(NOT_SUPPORTED)``.

A launch is queued on its stream and, when the stream reaches it, does
what the CUDA kernel does (the .cu file's header is the contract): after
``streams.kernel_delay(name)``, it reads the cancel word (if the pointer is not
null) and copies nothing when the word equals ``cancel_seq``; otherwise it
reads its three tables from (fake) device memory *then*, not at launch,
and copies every piece of chunks ``[0, n_chunks)`` x layers
``[layer_begin, layer_end)`` x planes x tokens x heads, ``(piece //
vec_bytes) * vec_bytes`` bytes a piece (``piece = row_bytes // heads``),
between ``plane_bases[l*planes+k] + page*page_stride + t*token_stride +
h*head_stride`` and the canonical offset ``chunk_ptrs[c] +
(((l*planes+k)*chunk_tokens + i)*heads + h)*piece``, leaving out the
pieces of a negative page id (kvd's SKIP_PAGE). A
``vec_bytes`` other than 16/8/4/2/1 copies nothing; an address not a
multiple of ``vec_bytes`` is a misaligned-address fault, an address no
region holds an illegal-address fault (fakecuda.memory). The cancel word is
read once per launch where the real kernel reads it once per block.
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import numpy as np

from . import streams, trace
from .errors import MISALIGNED_ADDRESS, NOT_SUPPORTED, CudaError
from .memory import SPACE

PARAMS = ("plane_bases", "page_ids", "chunk_ptrs", "n_chunks", "num_layers", "planes",
          "layer_begin", "layer_end", "chunk_tokens", "page_size", "page_stride",
          "token_stride", "row_bytes", "heads", "head_stride", "vec_bytes", "cancel", "cancel_seq")
KERNELS = ("kv_gather", "kv_scatter")


def kernel_params(code: str, name: str) -> tuple[str, ...]:
    """The parameter names of ``extern "C" __global__ void name(...)`` in ``code``."""
    m = re.search(r'extern\s+"C"\s+__global__\s+void\s+' + name + r"\s*\(([^)]*)\)", code)
    if m is None:
        return ()
    return tuple(re.findall(r"(\w+)\s*$", p.strip())[0] for p in m.group(1).split(","))


class RawModule:
    def __init__(self, code: str = "", options: tuple = (), **_: object) -> None:
        self._kernels = {}
        for name in KERNELS:
            if f"void {name}(" not in code:
                continue
            got = kernel_params(code, name)
            if got != PARAMS:
                raise CudaError(NOT_SUPPORTED, f"{name} takes {got}; the fake implements {PARAMS}: "
                                               "update tests/fakecuda/kernels.py with the kernel")
            self._kernels[name] = Kernel(name)

    def get_function(self, name: str) -> "Kernel":
        if name not in self._kernels:
            raise CudaError(NOT_SUPPORTED, f"the fake GPU has no kernel {name!r}")
        return self._kernels[name]


class Kernel:
    def __init__(self, name: str) -> None:
        self.name = name
        self.gather = name == "kv_gather"

    def __call__(self, grid, block, args, stream=None, shared_mem: int = 0) -> None:
        if len(args) != len(PARAMS):
            raise CudaError(NOT_SUPPORTED, f"{self.name} takes {len(PARAMS)} arguments, got {len(args)}")
        grid, block = tuple(grid), tuple(block)
        if not grid or min(grid) < 1 or not block or not 1 <= block[0] <= 1024:
            raise CudaError(NOT_SUPPORTED, f"bad launch shape grid={grid} block={block}")
        a = SimpleNamespace(**{k: int(v) for k, v in zip(PARAMS, args)})
        (stream or streams.current_stream()).enqueue(lambda: self._run(a))

    def _run(self, a: SimpleNamespace) -> None:
        t0 = time.monotonic()
        delay = streams.kernel_delay(self.name)
        if delay:
            time.sleep(delay)
        cancelled = bool(a.cancel) and int(
            SPACE.view(a.cancel, 4, what="cancel word").view("<u4")[0]) == a.cancel_seq & 0xFFFFFFFF
        touched: set[str] = set()
        if not cancelled and a.vec_bytes in (16, 8, 4, 2, 1):
            _copy(a, self.gather, touched)
        trace.emit("kernel", name=self.name, t0=t0, layers=[a.layer_begin, a.layer_end],
                   chunks=a.n_chunks, cancelled=cancelled, regions=sorted(touched))


def _copy(a: SimpleNamespace, gather: bool, touched: set) -> None:
    ppc = a.chunk_tokens // a.page_size
    first, planes = a.layer_begin * a.planes, (a.layer_end - a.layer_begin) * a.planes
    if a.n_chunks <= 0 or planes <= 0 or a.heads <= 0:  # the host never launches these
        return
    bases = SPACE.view(a.plane_bases + 8 * first, 8 * planes, what="plane_bases").view("<u8")
    pids = SPACE.view(a.page_ids, 8 * a.n_chunks * ppc, what="page_ids").view("<i8")
    ptrs = SPACE.view(a.chunk_ptrs, 8 * a.n_chunks, what="chunk_ptrs").view("<u8")
    piece = a.row_bytes // a.heads
    width = piece // a.vec_bytes * a.vec_bytes
    # pieces in canonical order: token-major, then head
    token = np.repeat(np.arange(a.chunk_tokens, dtype=np.int64), a.heads)
    head = np.tile(np.arange(a.heads, dtype=np.int64), a.chunk_tokens)
    in_page = token % a.page_size * a.token_stride + head * a.head_stride
    for c in range(a.n_chunks):
        pages = pids[c * ppc + token // a.page_size].astype(np.int64)
        for lo, hi in _kept(pages):  # the kernel skips the pieces of a negative page id
            for k in range(planes):
                pool = int(bases[k]) + pages[lo:hi] * a.page_stride + in_page[lo:hi]
                canon = int(ptrs[c]) + (first + k) * a.chunk_tokens * a.row_bytes + lo * piece
                _rows(pool, canon, a, piece, width, gather, touched)


def _kept(pages: np.ndarray) -> list[tuple[int, int]]:
    """Runs ``[lo, hi)`` of pieces whose page id is not negative."""
    keep = np.concatenate([[False], pages >= 0, [False]])
    edges = np.flatnonzero(keep[1:] != keep[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def _rows(pool: np.ndarray, canon: int, a: SimpleNamespace, piece: int, width: int,
          gather: bool, touched: set) -> None:
    """Copy ``width`` bytes of each piece between pool pieces at ``pool`` and the canonical
    pieces from ``canon`` (stride ``piece``)."""
    if a.vec_bytes > 1 and (np.any(pool % a.vec_bytes) or canon % a.vec_bytes
                            or piece % a.vec_bytes):
        raise CudaError(MISALIGNED_ADDRESS, f"a piece is not {a.vec_bytes}-byte aligned")
    lo, hi = int(pool.min()), int(pool.max()) + width
    region, off = SPACE.resolve(lo, hi - lo, what="pool rows")
    index = (pool - lo + off)[:, None] + np.arange(width)
    n = len(pool)
    c_region, c_off = SPACE.resolve(canon, (n - 1) * piece + width, what="chunk rows")
    rows = np.lib.stride_tricks.as_strided(c_region.array[c_off:], shape=(n, width),
                                           strides=(piece, 1))  # in bounds: resolved above
    touched.update((region.name, c_region.name))
    if gather:
        rows[:] = region.array[index]
    else:
        region.array[index] = rows
