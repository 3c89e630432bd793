"""CudaKVPool: describe an engine's torch CUDA KV tensors for ``register_kv``.

Takes tensors in the engine's own layout (kvd_protocol.layout: ``vllm_flash_attn``,
``vllm_flashinfer``, ``vllm_mla``, ``vllm_kv_blocks``, ``sglang_mha``/``sglang_mla``,
``page_first``, ``opaque``) and produces the layout descriptor and buffers: ``cuda_ipc``,
one per CUDA allocation with each tensor's offset in it, or, for virtual-memory allocations
(vLLM 0.34's extensible KV cache, sleep mode, expandable segments), ``cuda_vmm`` buffers whose
file descriptors ``lend_buffers`` passes at each registration (kvd_client.cuda_buffers).
``device_index`` and ``stream_ptr()`` let the client mark and wait on the engine's stream.
"""

from __future__ import annotations

from kvd_protocol import layout as L

from .cuda_buffers import CudaBuffers, torch_device_index, torch_extent


class CudaKVPool:
    def __init__(self, layout: str, tensors, page_size: int | None = None):
        import torch

        self.layout_name = layout
        flat = _flatten(layout, tensors)
        first = flat[0]
        if not first.is_cuda:
            raise ValueError("CudaKVPool takes CUDA tensors; use SharedKVPool for host memory")
        self.device = first.device
        self.kv_dtype = str(first.dtype).removeprefix("torch.")
        self.attention = "mla" if layout.endswith("mla") else "opaque" if layout == "opaque" else "mha"
        self.num_layers = len(flat) // (2 if layout == "sglang_mha" else 1)
        if layout == "page_first":
            self.num_layers = first.shape[1]
        self.kv_heads = 1 if self.attention == "mla" else first.shape[-2]
        self.head_dim = first.shape[-1]
        if layout == "vllm_kv_blocks":  # K and V side by side in each head
            self.kv_heads, self.head_dim = first.shape[1], first.shape[-1] // 2
        if layout == "opaque":  # [pages, kv_heads, page_size, row]: the head dim is the row
            self.kv_heads = first.shape[1]
        self.device_index = torch_device_index(first)
        self._cuda = CudaBuffers([(t.data_ptr(), torch_extent(t)) for t in flat], self.device_index)
        self.lends_fds, self.buffers = self._cuda.lends_fds, self._cuda.buffers
        refs = []
        for t, (index, offset) in zip(flat, self._cuda.place):
            item = t.element_size()
            refs.append(L.TensorRef(index, offset, tuple(t.shape),
                                    tuple(s * item for s in t.stride()), item))
        self.descriptor = L.describe(layout, refs, page_size)
        self.tensors = tensors  # keep the memory alive while registered
        self._torch = torch

    def lend_buffers(self, fd_socket, timeout: float) -> list[dict]:
        """The buffers, their allocations' file descriptors lent to the daemon anew."""
        return self._cuda.lend(fd_socket, timeout)

    def stream_ptr(self) -> int:
        """The engine's current CUDA stream on this pool's GPU (a ``cudaStream_t``)."""
        return self._torch.cuda.current_stream(self.device_index).cuda_stream


def _flatten(layout: str, tensors) -> list:
    if layout == "page_first":
        return [tensors]
    if layout == "sglang_mha":
        return [t for pair in tensors for t in pair]
    if layout not in L.LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(L.LAYOUTS)}")
    return list(tensors)
