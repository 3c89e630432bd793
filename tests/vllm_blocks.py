"""vLLM's GPU KV blocks in a /dev/shm file, registered as the vLLM connector's worker would.

``VllmBlocksPool(order, ...)`` allocates, layer after layer in one shared
memory file, per layer the logical ``[blocks, kv_heads, block_size, 2 *
head_size]`` tensor stored ``"HNC"`` (heads outer) or ``"NHC"`` (tokens
outer), and takes its descriptor from ``kvd_client.vllm.geometry.describe``
of the geometry the connector derives on a GPU (attention ``mha``, the plain
model id): it *is* a ``VllmKVPool``, so ``KvdClient.register_kv`` takes it
as the worker's pool. ``tensors`` are the logical views (numpy; 2-byte dtypes
as uint16).

Reference bytes never come from kvd's layout code: ``token_rows(pool, pages)``
reads the rows of every token kept in ``pages`` by the engines' own tensor
indexing, as ``[token, layer, plane, heads, head_dim bytes]``, for this pool and
for a ``SharedKVPool`` of ``vllm_flash_attn``; ``put_rows`` writes them so
into the same tensors re-created over another byte array (``over``), which
gives the exact pool a load must leave.
"""

from __future__ import annotations

import numpy as np

from kvd_client import shm
from kvd_client.pool import STORAGE
from kvd_client.vllm import geometry as G
from kvd_client.vllm.pool import VllmKVPool
from kvd_protocol import layout as L
from kvd_protocol.keys import DTYPE_SIZES


class VllmBlocksPool(VllmKVPool):
    layout_name = "vllm_kv_blocks"

    def __init__(self, order: str, num_layers: int, num_blocks: int, block_size: int,
                 kv_heads: int, head_size: int, dtype: str = "bfloat16", model: str = "tiny",
                 tp_size: int = 1, shm_dir: str = "/dev/shm"):
        if order not in ("HNC", "NHC"):
            raise ValueError("order must be HNC or NHC")
        item = DTYPE_SIZES[dtype]
        inner = (kv_heads, block_size) if order == "HNC" else (block_size, kv_heads)
        phys = (num_blocks, *inner, 2 * head_size)
        layer_bytes = int(np.prod(phys)) * item
        self.size = num_layers * layer_bytes
        self._file = shm.ShmFile.create("kvd-pool", self.size, shm_dir)
        self.path = self._file.path
        self.raw = np.frombuffer(self._file.map, dtype=np.uint8)
        tensors = [self.raw[i * layer_bytes:(i + 1) * layer_bytes].view(STORAGE[dtype]).reshape(phys)
                   for i in range(num_layers)]
        self.tensors = tensors if order == "HNC" else [t.transpose(0, 2, 1, 3) for t in tensors]
        self.geo = G.KVGeometry(model=model, kv_dtype=dtype, attention="mha", num_layers=num_layers,
                                kv_heads=kv_heads, head_dim=head_size, tp_size=tp_size,
                                block_size=block_size)
        refs = [L.TensorRef(0, i * layer_bytes, t.shape, t.strides, item)
                for i, t in enumerate(self.tensors)]
        super().__init__(self.geo, refs, [{"kind": "shm", "path": str(self.path), "size": self.size}],
                         num_blocks)

    def close(self) -> None:
        if getattr(self, "_file", None) is None:
            return
        self.tensors, self.raw = [], None
        self._file.close()
        self._file = None


class VllmMLAPool(VllmKVPool):
    """vLLM's MLA cache (0.26's shape: per layer ``[blocks, block_size, C]``, one latent row
    per token) in a /dev/shm file, layer after layer, described by the connector's code
    (attention ``mla``). ``rows(pages)``: ``[token, layer, C bytes]`` by plain indexing."""

    layout_name = "vllm_mla"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, dim: int,
                 dtype: str = "bfloat16", model: str = "tiny", shm_dir: str = "/dev/shm"):
        item = DTYPE_SIZES[dtype]
        layer_bytes = num_blocks * block_size * dim * item
        self.size = num_layers * layer_bytes
        self._file = shm.ShmFile.create("kvd-pool", self.size, shm_dir)
        self.raw = np.frombuffer(self._file.map, dtype=np.uint8)
        self.tensors = [self.raw[i * layer_bytes:(i + 1) * layer_bytes].view(STORAGE[dtype])
                        .reshape(num_blocks, block_size, dim) for i in range(num_layers)]
        self.geo = G.KVGeometry(model=model, kv_dtype=dtype, attention="mla", num_layers=num_layers,
                                kv_heads=1, head_dim=dim, tp_size=1, block_size=block_size)
        refs = [L.TensorRef(0, i * layer_bytes, t.shape, t.strides, item)
                for i, t in enumerate(self.tensors)]
        super().__init__(self.geo, refs, [{"kind": "shm", "path": str(self._file.path),
                                           "size": self.size}], num_blocks)

    def rows(self, pages) -> np.ndarray:
        rows = np.stack([t[np.asarray(pages)] for t in self.tensors])  # [L, n, bs, C]
        rows = rows.transpose(1, 2, 0, 3).reshape(-1, len(self.tensors), rows.shape[-1])
        return np.ascontiguousarray(rows).view(np.uint8)

    close = VllmBlocksPool.close


def over(pool, raw: np.ndarray) -> list[np.ndarray]:
    """The pool's tensors, same offsets, shapes and strides, over ``raw`` (a copy of its bytes)."""
    base = pool.raw.ctypes.data
    return [np.ndarray(t.shape, t.dtype, buffer=raw, offset=t.ctypes.data - base, strides=t.strides)
            for t in pool.tensors]


def _as_rows(pool, tensors: list) -> np.ndarray:
    """``[layer, plane, block, block_size, heads, head_dim]`` views of the pool's tensors."""
    if pool.layout_name == "vllm_kv_blocks":   # per layer [B, H, N, 2 * D]
        half = tensors[0].shape[-1] // 2
        return np.stack([np.stack([t[..., :half], t[..., half:]]) for t in tensors]
                        ).transpose(0, 1, 2, 4, 3, 5)
    if pool.layout_name == "vllm_flash_attn":  # per layer [2, B, N, H, D]
        return np.stack(tensors)
    raise AssertionError(f"no reference for {pool.layout_name}")


def token_rows(pool, pages, tensors: list | None = None) -> np.ndarray:
    """``[token, layer, plane, heads, head_dim bytes]`` (uint8: bytes compare exactly, NaNs
    too) of the tokens kept in ``pages``, in order."""
    rows = _as_rows(pool, pool.tensors if tensors is None else tensors)[:, :, np.asarray(pages)]
    n_layers, planes, n, bs = rows.shape[:4]
    rows = rows.transpose(2, 3, 0, 1, 4, 5).reshape(n * bs, n_layers, planes, *rows.shape[4:])
    return np.ascontiguousarray(rows).view(np.uint8)


def put_rows(pool, tensors: list, pages, rows: np.ndarray) -> None:
    """Write ``rows`` (as ``token_rows`` returns them) into ``pages`` of ``tensors``."""
    pages, ps = np.asarray(pages), pool.descriptor.page_size
    half = tensors[0].shape[-1] // 2
    for t, r in enumerate(rows):
        page, slot = pages[t // ps], t % ps
        for layer, x in enumerate(tensors):
            for plane in range(2):
                row = np.ascontiguousarray(r[layer, plane]).view(x.dtype)
                if pool.layout_name == "vllm_kv_blocks":
                    x[page, :, slot, plane * half:(plane + 1) * half] = row
                else:
                    x[plane, page, slot] = row
