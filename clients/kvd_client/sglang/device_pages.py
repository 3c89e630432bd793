"""SGLang's GPU KV pool as a kvd pool, and SGLang's device slots as kvd page ids.

``kvd_pool(kvcache, chunk_tokens)`` describes ``MHATokenToKVPool``/``MLATokenToKVPool`` as a
``CudaKVPool`` (layout ``sglang_mha``/``sglang_mla``, a kvd page = ``chunk_tokens`` slots)
exported by CUDA IPC; other pool classes are a ``ValueError``. ``page_ids(...)`` turns a
linker's page-aligned slots into kvd page ids, or None when not laid out so (SGLang then
recomputes). Never touches the pool's bytes.
"""

from __future__ import annotations

MHA, MLA = "MHATokenToKVPool", "MLATokenToKVPool"


def pool_kind(kvcache) -> str:
    """'sglang_mha' or 'sglang_mla' for SGLang's two plain device pools; ValueError else."""
    name = type(kvcache).__name__
    if name == MHA and hasattr(kvcache, "k_buffer") and hasattr(kvcache, "v_buffer"):
        k, v = kvcache.k_buffer[0], kvcache.v_buffer[0]
        if k.shape[1:] != v.shape[1:]:
            raise ValueError("kvd linker: K and V of different widths are not supported")
        return "sglang_mha"
    if name == MLA and hasattr(kvcache, "kv_buffer"):
        return "sglang_mla"
    raise ValueError(f"kvd linker: SGLang device pool {name} is not supported "
                     f"(supported: {MHA}, {MLA})")


def layer_tensors(kvcache):
    """The pool's per-layer tensors as ``CudaKVPool`` takes them for its layout."""
    if pool_kind(kvcache) == "sglang_mha":
        return list(zip(kvcache.k_buffer, kvcache.v_buffer))
    return list(kvcache.kv_buffer)


def kvd_pool(kvcache, chunk_tokens: int):
    """A ``CudaKVPool`` over SGLang's GPU KV tensors, ``chunk_tokens`` slots a kvd page."""
    from ..torch_pool import CudaKVPool

    return CudaKVPool(pool_kind(kvcache), layer_tensors(kvcache), chunk_tokens)


def page_ids(device_indices, pages: int, page_size: int, chunk_tokens: int) -> list[int] | None:
    """kvd page ids of ``pages`` SGLang pages at ``device_indices`` (``pages * page_size``
    slots), or None when a page's slots are not consecutive from a page-aligned first slot."""
    slots = [int(s) for s in device_indices.tolist()] if hasattr(device_indices, "tolist") \
        else [int(s) for s in device_indices]
    if len(slots) != pages * page_size or page_size % chunk_tokens:
        return None
    out = []
    for p in range(pages):
        first = slots[p * page_size]
        if first % page_size or slots[p * page_size:(p + 1) * page_size] != \
                list(range(first, first + page_size)):
            return None
        out.extend(range(first // chunk_tokens, (first + page_size) // chunk_tokens))
    return out
