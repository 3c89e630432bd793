"""The vLLM connector's GPU pool on vLLM 0.34's extensible KV cache, on the fake GPU.

vLLM 0.34 allocates its KV cache in CUDA virtual memory when the connector
answers ``EXPORTS_FD``; ``kvd_client.vllm.pool.cuda_pool`` must then lend the
allocations by file descriptor (``cuda_vmm`` buffers), not export them through
CUDA IPC (which refuses virtual memory). Its per-layer block tensors
(``[blocks, heads, block_size, 2 * head_dim]``) are laid out as 0.34's cache
lays them out (tests/fakecuda/engine.vmm_kv_tensors), registered with a real
``kvd serve --gpu on``; a store then a load into other blocks is byte-exact
and leaves the other blocks as they were; ordinary allocations still go
through CUDA IPC.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import kvd_client
from kvd_client.vllm.geometry import KVGeometry
from kvd_client.vllm.pool import cuda_pool

CHUNK, LAYERS, BLOCKS, BS, HEADS, DIM = 16, 4, 64, 16, 8, 64
GEO = KVGeometry(model="vllm-vmm", kv_dtype="bfloat16", attention="mha", num_layers=LAYERS,
                 kv_heads=HEADS, head_dim=DIM, tp_size=1, block_size=BS)


class TorchView:
    """What kvd_client.vllm.pool reads of a torch tensor (torch is not in the CPU tests'
    environment), over a numpy view of fake device memory."""

    def __init__(self, a: np.ndarray):
        self.a, self.shape, self.device = a, a.shape, SimpleNamespace(index=0)

    def data_ptr(self) -> int:
        return self.a.ctypes.data

    def element_size(self) -> int:
        return self.a.itemsize

    def stride(self) -> tuple:
        return tuple(s // self.a.itemsize for s in self.a.strides)

    def numel(self) -> int:
        return self.a.size


def vllm_pool(tensors, stream):
    pool = cuda_pool(GEO, [TorchView(t) for t in tensors], BLOCKS)
    pool.stream_ptr = lambda: stream.ptr  # the engine's stream: a fake one, not torch's
    return pool


def test_the_extensible_cache_is_lent_by_fd_and_loads_exact(fake_engine, fake_daemon):
    from fakecuda import engine
    d = fake_daemon(chunk_tokens=CHUNK, host_capacity="256MiB", gpu_copy_path="dma")
    tensors, mapping = engine.vmm_kv_tensors("vllm_kv_blocks", LAYERS, BLOCKS, BS, HEADS, DIM, seed=34)
    try:
        pool = vllm_pool(tensors, fake_engine.stream)
        assert pool.lends_fds and [b["kind"] for b in pool.buffers] == ["cuda_vmm"]
        with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True, timeout=30) as c:
            c.connect()
            reg = c.register_kv(pool, model=GEO.model)
            tokens = np.arange(4 * CHUNK) + 34
            want = [t[0:4].copy() for t in tensors]
            assert c.store(tokens, range(4)) == 4 * CHUNK
            for t in tensors:
                t[8:12] = 0xA5A5
            outside = [np.concatenate([t[4:8], t[12:]]).copy() for t in tensors]
            assert c.load(tokens, range(8, 12)) == 4 * CHUNK
            assert fake_engine.stream.synchronize(timeout=30)
            for t, w, o in zip(tensors, want, outside):
                assert np.array_equal(t[8:12], w)
                assert np.array_equal(np.concatenate([t[4:8], t[12:]]), o)
            c.unregister(reg)
    finally:
        mapping.close()
    assert "Traceback" not in d.log(), d.log()


def test_ordinary_allocations_still_go_through_cuda_ipc(fake_engine):
    _, flat, _ = fake_engine.tensors("vllm_kv_blocks", LAYERS, BLOCKS, BS, HEADS, DIM)
    pool = vllm_pool(flat, fake_engine.stream)
    assert not pool.lends_fds and [b["kind"] for b in pool.buffers] == ["cuda_ipc"]


def test_a_mix_of_both_is_refused(fake_engine):
    from fakecuda import engine
    vmm, mapping = engine.vmm_kv_tensors("vllm_kv_blocks", 2, BLOCKS, BS, HEADS, DIM)
    _, flat, _ = fake_engine.tensors("vllm_kv_blocks", 2, BLOCKS, BS, HEADS, DIM)
    try:
        with pytest.raises(ValueError, match="mix virtual-memory and ordinary"):
            cuda_pool(GEO, [TorchView(t) for t in vmm + flat], BLOCKS)
    finally:
        mapping.close()
