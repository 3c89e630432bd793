"""Direct copies: one DMA per contiguous run of token rows, batched in one driver call.

Where a page's token rows are contiguous in the pool (``token_stride ==
row_bytes``, true of every layout kvd knows) and a page of one plane is at
least ``MIN_RUN_BYTES``, a copy needs no kernel at all: each (layer, chunk,
plane, page) is one contiguous run on both sides, and the copy engines
move the runs straight between the engine's pool and the pinned arena.
No SM is used, so the engine's kernels are not slowed and, without MPS,
the daemon never has to win a compute time slice from the engine.

Contract:

- ``BatchDma()`` binds ``cuMemcpyBatchAsync`` (CUDA 12.8+ drivers) through
  ``cuGetProcAddress``; it raises ``RuntimeError`` where the driver lacks it.
  ``copy(dsts, srcs, sizes, stream)`` enqueues one batch on a CuPy stream
  (arrays of addresses and byte counts, int64; the batch as a whole is in
  stream order, the copies within it in no particular order).
- ``direct_runs(...)`` returns, per layer of ``layers``, the runs of that
  layer for all chunks: ``(pool_addrs, canonical_addrs, sizes)``, runs
  adjacent on both sides merged (consecutive page ids of one chunk).
"""

from __future__ import annotations

import ctypes

import numpy as np

MIN_RUN_BYTES = 32 << 10
_ORDER_STREAM = 1          # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_PREFER_OVERLAP = 1        # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes_v1
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location),
                ("dstLocHint", _Location), ("flags", ctypes.c_uint)]


_BATCH_12080 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.c_void_p, ctypes.c_void_p)


class BatchDma:
    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn, status = ctypes.c_void_p(), ctypes.c_int()
            rc = lib.cuGetProcAddress_v2(b"cuMemcpyBatchAsync", ctypes.byref(fn), 12080,
                                         ctypes.c_uint64(0), ctypes.byref(status))
        except (OSError, AttributeError) as exc:
            raise RuntimeError(f"no cuMemcpyBatchAsync: {exc}") from None
        if rc != 0 or not fn.value:
            raise RuntimeError(f"no cuMemcpyBatchAsync in this driver (status {rc}/{status.value})")
        self._fn = _BATCH_12080(fn.value)
        self._attr = _Attributes(_ORDER_STREAM, _Location(0, 0), _Location(0, 0), _PREFER_OVERLAP)
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream) -> None:
        if not len(sizes):
            return
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.int64) for a in (dsts, srcs, sizes))
        rc = self._fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
                      ctypes.addressof(self._attr), ctypes.addressof(self._attr_idx), 1,
                      ctypes.addressof(self._fail), stream.ptr)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUDA driver error {rc} "
                               f"(copy {self._fail.value} of {len(sizes)})")


def direct_runs(bases: np.ndarray, page_ids: np.ndarray, shard_ptrs: np.ndarray, layers: range,
                planes: int, chunk_tokens: int, page_size: int, page_stride: int,
                row_bytes: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per layer, the merged runs ``(pool, canonical, size)`` of every chunk."""
    ppc = chunk_tokens // page_size
    n = len(shard_ptrs)
    run = page_size * row_bytes
    base = np.asarray(bases, dtype=np.uint64).astype(np.int64).reshape(-1, planes)
    pages = np.asarray(page_ids, dtype=np.int64).reshape(n, ppc)
    shards = np.asarray(shard_ptrs, dtype=np.uint64).astype(np.int64)
    plane = np.arange(planes, dtype=np.int64)
    slot = np.arange(ppc, dtype=np.int64)
    out = []
    for layer in layers:
        # (chunk, plane, page): canonical order within each chunk
        pool = base[layer][None, :, None] + pages[:, None, :] * page_stride
        canon = shards[:, None, None] + (((layer * planes + plane) * chunk_tokens)[None, :, None]
                                         + slot[None, None, :] * page_size) * row_bytes
        pool, canon = pool.reshape(-1), canon.reshape(-1)
        starts = np.ones(len(pool), dtype=bool)
        starts[1:] = (pool[1:] != pool[:-1] + run) | (canon[1:] != canon[:-1] + run)
        first = np.flatnonzero(starts)
        sizes = np.diff(np.append(first, len(pool))) * run
        out.append((pool[first], canon[first], sizes))
    return out
