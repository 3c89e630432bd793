"""SGLang's device pool moved into a kvd ``SharedKVPool`` of its layout: the CPU tests' pool.

The daemon cannot map CPU tensors SGLang allocated; on a GPU kvd registers the pool's own
tensors by CUDA IPC (kvd_client.sglang.device_pages.kvd_pool). ``shm_device_pool`` is the
``pool_factory`` the linker and radix-cache workers give kvd's classes instead: the pool's
per-layer tensors become views of a ``SharedKVPool`` (``sglang_mha`` / ``sglang_mla``), so
SGLang's reads and writes and the daemon's copies meet in the same bytes.
"""

from __future__ import annotations

import torch

from kvd_client import SharedKVPool
from kvd_client.sglang import device_pages

TORCH_FROM_STORAGE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def shm_device_pool(kvcache, chunk_tokens: int) -> SharedKVPool:
    """A SharedKVPool of the device pool's layout; the pool's tensors now live in it."""
    kind = device_pages.pool_kind(kvcache)
    first = device_pages.layer_tensors(kvcache)[0]
    first = first[0] if kind == "sglang_mha" else first
    slots, heads, dim = first.shape
    dtype = str(first.dtype).removeprefix("torch.")
    pool = SharedKVPool(kind, kvcache.layer_num, slots // chunk_tokens, chunk_tokens, heads, dim,
                        dtype)
    views = [torch.from_numpy(a).view(TORCH_FROM_STORAGE[dtype]) for a in pool.tensors]
    if kind == "sglang_mha":
        kvcache.k_buffer = [v.copy_(k) for v, k in zip(views[0::2], kvcache.k_buffer)]
        kvcache.v_buffer = [v.copy_(k) for v, k in zip(views[1::2], kvcache.v_buffer)]
    else:
        kvcache.kv_buffer = [v.copy_(k) for v, k in zip(views, kvcache.kv_buffer)]
    return pool
