"""KV in CUDA virtual memory (vLLM 0.34's extensible KV cache), shared with kvd by file descriptor.

A real daemon with the CUDA backend; this process is the engine. Its KV is made
as vLLM 0.34 makes it: one reserved address range, physical allocations created
exportable as POSIX file descriptors mapped into it (a segment per layer; two
allocations per layer in one case, as a cache committed in steps has), wrapped
as torch tensors (kvd.bench.vmm_pool). ``CudaKVPool`` finds the allocations,
lends their descriptors over fds.sock and registers ``cuda_vmm`` buffers; the
daemon maps them. Checked: stores and loads are byte-exact (fresh random data,
destination pages poisoned first, pages outside the load untouched), the
daemon keeps none of the lent descriptors (its descriptor count back under
what it was plus the pool's pieces), and a
descriptor that is not a CUDA allocation is refused with the daemon still
serving. The kill checks are in test_gpu_faults.py (pool kind ``vmm``).
Skipped without torch, cupy or a GPU.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from gpu_env import require_gpu  # noqa: E402

torch = require_gpu()

import kvd_client  # noqa: E402
from kvd.bench.vmm_pool import vmm_layers  # noqa: E402
from kvd_client.torch_pool import CudaKVPool  # noqa: E402
from kvd_protocol import fd_pass  # noqa: E402
from kvd_protocol.errors import BadRequest  # noqa: E402
from kvd_protocol.runtime import fd_socket_path  # noqa: E402

pytestmark = pytest.mark.gpu
CHUNK = 64
KNOBS = {"chunk_tokens": CHUNK, "host_capacity": "1GiB", "gpu": "on", "client_timeout_s": 2.0,
         "heartbeat_interval_s": 0.2}
SHAPE = (2, 128, 16, 8, 128)  # flash-attn layer: K/V, pages, page size, heads, head dim (bf16)


def vmm_kv(layers: int, chunks_per_layer: int) -> list:
    nbytes = int(np.prod(SHAPE)) * 2
    return [t.random_(0, 256).view(torch.bfloat16).view(SHAPE)
            for t in vmm_layers(torch, nbytes, layers, chunks_per_layer)]


def daemon_fds(d) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def settled_below(d, limit: int) -> bool:
    """Whether the daemon's descriptor count comes under ``limit`` (its closes follow its
    replies). Limits leave room for a descriptor the driver may open by itself, never for
    the pool's lent ones."""
    end = time.monotonic() + 10
    while daemon_fds(d) >= limit and time.monotonic() < end:
        time.sleep(0.05)
    return daemon_fds(d) < limit


@pytest.mark.parametrize("chunks_per_layer", [1, 2])
def test_vmm_pool_stores_and_loads_byte_exact(start_daemon, chunks_per_layer):
    d = start_daemon(**KNOBS)
    assert fd_socket_path(d.runtime_dir).exists(), d.log()
    kv = vmm_kv(4, chunks_per_layer)
    pool = CudaKVPool("vllm_flash_attn", kv)
    assert pool.lends_fds and {b["kind"] for b in pool.buffers} == {"cuda_vmm"}
    assert len(pool.buffers) == 1  # the segments are mapped end to end: one range
    assert len(pool.buffers[0]["pieces"]) == 4 * chunks_per_layer
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True, timeout=10) as c:
        c.connect()
        warm = c.register_kv(pool, model="vmm-gpu")  # the daemon's GPU set-up and first copies
        assert c.store(np.arange(CHUNK), range(4)) == CHUNK and c.load(np.arange(CHUNK), range(4))
        c.unregister(warm)
        base = daemon_fds(d)
        reg = c.register_kv(pool, model="vmm-gpu")
        rng = np.random.default_rng(58)
        for x in kv:  # fresh data after registering: the daemon reads the memory, not a copy
            x.view(torch.uint8).copy_(torch.from_numpy(
                rng.integers(0, 256, x.view(torch.uint8).shape, dtype=np.uint8)).cuda())
        tokens = np.arange(8 * CHUNK) + 58
        want = [x[:, 0:32].clone() for x in kv]
        torch.cuda.synchronize()
        assert c.store(tokens, range(32)) == 8 * CHUNK
        for x in kv:
            x[:, 64:96].view(torch.uint8).fill_(0xA5)
        outside = [torch.cat([x[:, 32:64], x[:, 96:]], 1).clone() for x in kv]
        torch.cuda.synchronize()
        assert c.load(tokens, range(64, 96)) == 8 * CHUNK
        torch.cuda.synchronize()
        for x, w, o in zip(kv, want, outside):
            assert torch.equal(x[:, 64:96].view(torch.uint8), w.view(torch.uint8))
            assert torch.equal(torch.cat([x[:, 32:64], x[:, 96:]], 1).view(torch.uint8),
                               o.view(torch.uint8))
        c.unregister(reg)
        pieces = sum(len(b["pieces"]) for b in pool.buffers)
        assert settled_below(d, base + pieces), "descriptors of the pool stayed open in the daemon"
    assert "Traceback" not in d.log(), d.log()


def test_a_descriptor_that_is_no_cuda_allocation_is_refused(start_daemon):
    d = start_daemon(**KNOBS)
    kv = vmm_kv(2, 1)
    pool = CudaKVPool("vllm_flash_attn", kv)
    n = sum(len(b["pieces"]) for b in pool.buffers)  # one descriptor per mapped piece
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True, timeout=10) as c:
        c.connect()
        reg = c.register_kv(pool, model="vmm-gpu")  # its request's fields, flag page included
        base = daemon_fds(d)
        fake = os.memfd_create("not-cuda")
        os.ftruncate(fake, pool.buffers[0]["size"])
        try:
            token = fd_pass.lend(fd_socket_path(d.runtime_dir), [fake] * n)
        finally:
            os.close(fake)
        assert daemon_fds(d) >= base + n  # held for the registration
        bad = {**reg.fields, "buffers": [{**b, "token": token} for b in pool.buffers]}
        with pytest.raises(BadRequest, match="not a CUDA allocation|cannot map"):
            c._call("register", bad)
        assert settled_below(d, base + n)  # the lent descriptors were closed
        tokens = np.arange(2 * CHUNK)
        torch.cuda.synchronize()
        assert c.store(tokens, range(8)) == 2 * CHUNK  # the daemon serves on
        c.unregister(reg)
    assert "Traceback" not in d.log(), d.log()
