"""vLLM's own KV tensors as a kvd pool, for ``KvdClient.register_kv``.

``tensor_ref(t, base)`` describes a tensor at its offset from ``base``; ``host_pool`` names the
connector's /dev/shm file (kvd_client.vllm.shm_alloc) as one ``shm`` buffer; ``cuda_pool``
exports one ``cuda_ipc`` buffer per CUDA allocation. Both return a ``VllmKVPool`` whose
descriptor comes from kvd_client.vllm.geometry; a tensor outside its memory raises
``ValueError``. ``state_block(t)``: the tensor that starts a state layer's blocks.
"""

from __future__ import annotations

from kvd_protocol import layout as L

from .geometry import KVGeometry, describe


class VllmKVPool:
    """What ``register_kv`` reads: descriptor, buffers, dtype and head geometry."""

    def __init__(self, geo: KVGeometry, refs: list[L.TensorRef], buffers: list[dict], num_blocks: int):
        self.descriptor = describe(geo, refs, num_blocks)
        self.buffers = buffers
        self.kv_dtype, self.attention = geo.kv_dtype, geo.attention
        self.num_layers, self.kv_heads, self.head_dim = geo.num_layers, geo.kv_heads, geo.head_dim


class CudaVllmKVPool(VllmKVPool):
    """A pool on a GPU: stores are ordered after, and layer-wise loads before, the
    engine's work on its current stream (kvd_client.flags)."""

    def __init__(self, geo, refs, buffers, num_blocks, device_index: int):
        super().__init__(geo, refs, buffers, num_blocks)
        self.device_index = device_index

    def stream_ptr(self) -> int:
        import torch

        return torch.cuda.current_stream(self.device_index).cuda_stream


def state_block(t):
    return t[0] if isinstance(t, (list, tuple)) else t


def tensor_ref(t, buffer: int, base: int) -> L.TensorRef:
    item = t.element_size()
    return L.TensorRef(buffer, t.data_ptr() - base, tuple(t.shape),
                       tuple(s * item for s in t.stride()), item)


def host_pool(geo: KVGeometry, tensors: list, path: str, base: int, size: int,
              num_blocks: int) -> VllmKVPool:
    """Tensors inside the mapping of ``path`` (``size`` bytes at address ``base``)."""
    refs = [tensor_ref(t, 0, base) for t in tensors]
    for r in refs:
        if r.offset < 0 or r.offset >= size:
            raise ValueError("kvd: vLLM's KV cache is not in the connector's shared-memory file "
                             "(vLLM did not allocate it inside get_mem_pool_context)")
    return VllmKVPool(geo, refs, [{"kind": "shm", "path": path, "size": size}], num_blocks)


def cuda_pool(geo: KVGeometry, tensors: list, num_blocks: int) -> CudaVllmKVPool:
    from kvd_protocol.cuda_driver import export_allocation

    buffers, refs, index = [], [], {}
    for t in tensors:
        alloc = export_allocation(t.data_ptr())  # says what to change if it cannot
        if alloc.base not in index:
            index[alloc.base] = len(buffers)
            buffers.append({"kind": "cuda_ipc", "handle": alloc.handle, "offset": 0,
                            "size": alloc.size, "device_uuid": alloc.device_uuid})
        refs.append(tensor_ref(t, index[alloc.base], alloc.base))
    device = tensors[0].device.index
    if device is None:
        import torch

        device = torch.cuda.current_device()
    return CudaVllmKVPool(geo, refs, buffers, num_blocks, device)
