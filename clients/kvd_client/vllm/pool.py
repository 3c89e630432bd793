"""vLLM's own KV tensors as a kvd pool, for ``KvdClient.register_kv``.

``tensor_ref(t, buffer, offset)`` describes a tensor at ``offset`` in a buffer; ``host_pool``
names the connector's /dev/shm file (kvd_client.vllm.shm_alloc) as one ``shm`` buffer;
``cuda_pool`` exports one ``cuda_ipc`` buffer per CUDA allocation, or lends 0.34's extensible
KV cache (CUDA virtual memory) by file descriptor as ``cuda_vmm`` buffers. Both return a
``VllmKVPool`` whose descriptor comes from kvd_client.vllm.geometry; a tensor outside its
memory raises ``ValueError``. ``state_block(t)``: the tensor that starts a state layer's blocks.
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
    engine's work on its current stream (kvd_client.flags). A virtual-memory pool lends its
    allocations' file descriptors at each registration (``lends_fds``, ``lend_buffers``)."""

    def __init__(self, geo, refs, cuda, num_blocks, device_index: int):
        super().__init__(geo, refs, cuda.buffers, num_blocks)
        self.device_index = device_index
        self.lends_fds, self._cuda = cuda.lends_fds, cuda

    def lend_buffers(self, fd_socket, timeout: float) -> list[dict]:
        return self._cuda.lend(fd_socket, timeout)

    def stream_ptr(self) -> int:
        import torch

        return torch.cuda.current_stream(self.device_index).cuda_stream


def state_block(t):
    return t[0] if isinstance(t, (list, tuple)) else t


def tensor_ref(t, buffer: int, offset: int) -> L.TensorRef:
    item = t.element_size()
    return L.TensorRef(buffer, offset, tuple(t.shape),
                       tuple(s * item for s in t.stride()), item)


def host_pool(geo: KVGeometry, tensors: list, path: str, base: int, size: int,
              num_blocks: int) -> VllmKVPool:
    """Tensors inside the mapping of ``path`` (``size`` bytes at address ``base``)."""
    refs = [tensor_ref(t, 0, t.data_ptr() - base) for t in tensors]
    for r in refs:
        if r.offset < 0 or r.offset >= size:
            raise ValueError("kvd: vLLM's KV cache is not in the connector's shared-memory file "
                             "(vLLM did not allocate it inside get_mem_pool_context)")
    return VllmKVPool(geo, refs, [{"kind": "shm", "path": path, "size": size}], num_blocks)


def cuda_pool(geo: KVGeometry, tensors: list, num_blocks: int) -> CudaVllmKVPool:
    """``cuda_ipc`` buffers, or ``cuda_vmm`` ones lent by file descriptor where vLLM 0.34's
    extensible KV cache (CUDA virtual memory) holds the tensors (kvd_client.cuda_buffers)."""
    from ..cuda_buffers import CudaBuffers, torch_device_index, torch_extent

    device = torch_device_index(tensors[0])
    cuda = CudaBuffers([(t.data_ptr(), torch_extent(t)) for t in tensors], device)
    refs = [tensor_ref(t, index, offset) for t, (index, offset) in zip(tensors, cuda.place)]
    return CudaVllmKVPool(geo, refs, cuda, num_blocks, device)
