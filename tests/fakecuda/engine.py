"""An engine on the fake GPU: KV tensors in fake device memory, and the pool that exports them.

``kv_tensors(layout, layers, pages, page_size, heads, dim)`` allocates one
fake device allocation (fakecuda.memory) and places the layout's tensors in
it at 256-byte aligned offsets after a gap, as a caching allocator hands
out tensors in the middle of a block; they are numpy arrays (2-byte
elements stand for bfloat16), filled with random bytes, so the engine's
CPU reads and writes "GPU" memory directly where a torch test would copy.
``vllm_kv_blocks`` are vLLM's GPU blocks, per layer the logical ``[blocks,
heads, block_size, 2 * dim]`` stored heads outer; ``vllm_kv_blocks_nhc``
the same stored tokens outer (the tensors are the logical views).
``vmm_kv_tensors`` places per-layer tensors in fake CUDA virtual memory as
vLLM 0.34 does (their pool lends file descriptors through kvd_client.cuda_buffers).
``FakeCudaKVPool`` is ``kvd_client.torch_pool.CudaKVPool`` for such
tensors: it exports each tensor's allocation through cuda_driver (the fake
libcuda: fakecuda.driver), builds the same layout descriptor and buffer
list, and names its engine stream (a fakecuda ``Stream`` on which the test
queues the "forward pass": ``launch(fn)``, ``sleep(s)``) for the client's
marks and layer waits. The test process must have called
``fakecuda.driver.install()``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvd_client.cuda_buffers import CudaBuffers
from kvd_protocol import layout as L

from .memory import SPACE
from .streams import Stream

ALIGN = 256
GAP = 4096  # bytes before the first tensor of an allocation


def shapes(layout: str, layers: int, pages: int, ps: int, heads: int, dim: int) -> list[tuple]:
    """Each tensor's shape, flattened as ``CudaKVPool`` flattens them (sglang_mha: K0, V0, ...)."""
    per_layer = {"vllm_flash_attn": [(2, pages, ps, heads, dim)],
                 "vllm_flashinfer": [(pages, 2, ps, heads, dim)],
                 "vllm_mla": [(pages, ps, dim)],
                 "vllm_kv_blocks": [(pages, heads, ps, 2 * dim)],
                 "vllm_kv_blocks_nhc": [(pages, ps, heads, 2 * dim)],  # physical order
                 "sglang_mha": [(pages * ps, heads, dim)] * 2,
                 "sglang_mla": [(pages * ps, 1, dim)]}
    if layout == "page_first":
        return [(pages, layers, 2, ps, heads, dim)]
    return per_layer[layout] * layers


def kv_tensors(layout: str, layers: int, pages: int, page_size: int, heads: int, dim: int,
               seed: int = 0):
    """(the tensors as the layout passes them to the pool, the flat list, the allocation)."""
    flat_shapes = shapes(layout, layers, pages, page_size, heads, dim)
    offsets, end = [], GAP
    for shape in flat_shapes:
        offsets.append(end)
        end += -(-int(np.prod(shape)) * 2 // ALIGN) * ALIGN
    region = SPACE.alloc(end + GAP)
    region.array[:] = np.random.default_rng(seed).integers(0, 256, region.size, dtype=np.uint8)
    flat = [region.array[o:o + int(np.prod(s)) * 2].view(np.uint16).reshape(s)
            for o, s in zip(offsets, flat_shapes)]
    if layout == "sglang_mha":
        return list(zip(flat[0::2], flat[1::2])), flat, region
    if layout == "vllm_kv_blocks_nhc":  # logical [blocks, heads, block_size, 2 * dim] views
        flat = [t.transpose(0, 2, 1, 3) for t in flat]
    return (flat[0] if layout == "page_first" else flat), flat, region


def vmm_kv_tensors(layout: str, layers: int, pages: int, page_size: int, heads: int, dim: int,
                   chunks_per_layer: int = 1, seed: int = 0):
    """Per-layer tensors in fake virtual memory laid out as vLLM 0.34's extensible KV cache
    (one reserved range, each layer's segment on a granule, ``chunks_per_layer`` physical
    allocations each, created exportable), made through kvd_protocol.cuda_vmm.allocate on
    the fake driver; (tensors, the mapping)."""
    from kvd_protocol import cuda_vmm

    shape = shapes(layout, 1, pages, page_size, heads, dim)[0]
    nbytes = int(np.prod(shape)) * 2
    grain = cuda_vmm.granularity(0)
    chunk = -(-nbytes // (chunks_per_layer * grain)) * grain
    mapping = cuda_vmm.allocate([chunk] * (chunks_per_layer * layers), 0)
    whole = np.ctypeslib.as_array((ctypes.c_uint8 * mapping.size).from_address(mapping.base))
    whole[:] = np.random.default_rng(seed).integers(0, 256, mapping.size, dtype=np.uint8)
    seg = chunk * chunks_per_layer
    return [whole[i * seg:i * seg + nbytes].view(np.uint16).reshape(shape)
            for i in range(layers)], mapping


class FakeCudaKVPool:
    def __init__(self, layout: str, tensors, page_size: int | None = None,
                 kv_dtype: str = "bfloat16", stream: Stream | None = None):
        flat = [tensors] if layout == "page_first" else (
            [t for pair in tensors for t in pair] if layout == "sglang_mha" else list(tensors))
        first = flat[0]
        self.layout_name = layout
        self.kv_dtype = kv_dtype
        self.attention = "mla" if layout.endswith("mla") else "mha"
        self.num_layers = first.shape[1] if layout == "page_first" else \
            len(flat) // (2 if layout == "sglang_mha" else 1)
        self.kv_heads = 1 if self.attention == "mla" else first.shape[-2]
        self.head_dim = first.shape[-1]
        if layout.startswith("vllm_kv_blocks"):  # [blocks, heads, block_size, 2 * head_dim]
            self.kv_heads, self.head_dim = first.shape[1], first.shape[-1] // 2
            layout = "vllm_kv_blocks"
        self._cuda = CudaBuffers([(t.ctypes.data, t.nbytes) for t in flat], 0)  # kvd_client's own
        self.lends_fds, self.buffers = self._cuda.lends_fds, self._cuda.buffers
        refs = [L.TensorRef(i, off, tuple(t.shape), tuple(t.strides), t.itemsize)
                for t, (i, off) in zip(flat, self._cuda.place)]
        self.descriptor = L.describe(layout, refs, page_size)
        self.tensors = tensors
        self.device_index = 0
        self.stream = stream or Stream(name="engine")

    def lend_buffers(self, fd_socket, timeout: float) -> list[dict]:
        return self._cuda.lend(fd_socket, timeout)

    def stream_ptr(self) -> int:
        """The engine's current stream (a ``cudaStream_t`` of the fake GPU)."""
        return self.stream.ptr
