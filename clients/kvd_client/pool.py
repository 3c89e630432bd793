"""SharedKVPool: an engine KV pool in a shared-memory file (host backend).

Allocates in one /dev/shm file the zero-filled tensors of a ``kvd_protocol.layout`` layout
and exposes what ``register_kv`` needs (descriptor, buffers, dtype, heads). The file
(kvd_client.shm) is 0600, or 0660 of ``group`` for a daemon of another user, flocked for the
pool's life and unlinked by ``close``/at exit; dead processes' files are removed only once
their lock is free (safe across pid namespaces sharing /dev/shm).
"""

from __future__ import annotations

import atexit

import numpy as np

from kvd_protocol import layout as L
from kvd_protocol.keys import DTYPE_SIZES

from . import shm

STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
           "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8, "int8": np.int8, "uint8": np.uint8}
ALIGN = 256


def _shapes(layout: str, n_layers: int, pages: int, ps: int, heads: int, dim: int) -> list:
    per_layer = {"vllm_flash_attn": [(2, pages, ps, heads, dim)],
                 "vllm_flashinfer": [(pages, 2, ps, heads, dim)],
                 "vllm_mla": [(pages, ps, dim)],
                 "vllm_kv_blocks": [(pages, heads, ps, 2 * dim)],  # GPU blocks, HNC order
                 "sglang_mha": [(pages * ps, heads, dim)] * 2,
                 "sglang_mla": [(pages * ps, 1, dim)],
                 "opaque": [(pages, heads, ps, dim)]}  # vLLM's CPU cache shape
    if layout == "page_first":
        return [(pages, n_layers, 2, ps, heads, dim)]
    if layout not in per_layer:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(L.LAYOUTS)}")
    return per_layer[layout] * n_layers


class SharedKVPool:
    def __init__(self, layout: str, num_layers: int, num_pages: int, page_size: int,
                 kv_heads: int, head_dim: int, dtype: str = "float16", shm_dir: str = "/dev/shm",
                 group: str | int | None = None):
        if dtype not in STORAGE:
            raise ValueError(f"dtype must be one of {sorted(STORAGE)}")
        self.layout_name, self.kv_dtype = layout, dtype
        self.attention = "mla" if layout.endswith("mla") else "opaque" if layout == "opaque" else "mha"
        if self.attention == "mla" and kv_heads != 1:
            raise ValueError("MLA pools have kv_heads == 1")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        shapes = _shapes(layout, num_layers, num_pages, page_size, kv_heads, head_dim)
        item = DTYPE_SIZES[dtype]
        offsets, size = [], 0
        for shape in shapes:
            offsets.append(size)
            size += -(-int(np.prod(shape)) * item // ALIGN) * ALIGN
        self._file = shm.ShmFile.create("kvd-pool", size, shm_dir, group)
        self.path = self._file.path
        atexit.register(self.close)
        self.size = size
        self.raw = np.frombuffer(self._file.map, dtype=np.uint8)
        self.tensors = [self.raw[o:o + int(np.prod(s)) * item].view(STORAGE[dtype]).reshape(s)
                        for o, s in zip(offsets, shapes)]
        refs = [L.TensorRef(0, o, s, t.strides, item) for o, s, t in zip(offsets, shapes, self.tensors)]
        self.descriptor = L.describe(layout, refs, page_size)
        self.buffers = [{"kind": "shm", "path": str(self.path), "size": size}]

    def close(self) -> None:
        if getattr(self, "_file", None) is None:
            return
        self.tensors, self.raw = [], None
        self._file.close()

