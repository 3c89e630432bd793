"""Warm restart on the GPU: a host tier filled from CUDA pools, kept across a daemon's
SIGTERM or SIGKILL, is adopted by the next daemon and loaded back into a CUDA pool
byte for byte (the CUDA backend pins and maps the adopted arena as it does a new one).

The engine is this test process (torch tensors on the GPU, CUDA IPC); the second
daemon serves the same runtime dir. The loaded pages are compared with the stored
ones; pages outside the load keep their poison. Skipped without torch, cupy or a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from daemons import wait_for
from gpu_env import require_gpu  # noqa: E402

torch = require_gpu()

import kvd_client  # noqa: E402
from kvd_client.torch_pool import CudaKVPool  # noqa: E402

pytestmark = pytest.mark.gpu
CHUNK, PAGE, CHUNKS = 64, 16, 8
KNOBS = {"chunk_tokens": CHUNK, "host_capacity": "256MiB", "gpu": "on", "shutdown_grace_s": 8.0}


def tensors(fill=None, layers=4, pages=128, heads=4, dim=64):
    def one():
        t = torch.randint(0, 256, (2, pages, PAGE, heads, dim * 2), dtype=torch.uint8, device="cuda")
        if fill is not None:
            t.fill_(fill)
        return t.view(torch.bfloat16)
    return [one() for _ in range(layers)]


def engine(d, kv):
    client = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), timeout=30,
                                  raise_errors=True).connect()
    client.register_kv(CudaKVPool("vllm_flash_attn", kv), model="warm-gpu")
    return client


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_cuda_pool_loads_what_an_adopted_host_tier_kept(start_daemon, how):
    first = start_daemon(**KNOBS)
    kv = tensors()
    client = engine(first, kv)
    tokens = np.arange(CHUNKS * CHUNK) + 4242
    pages = CHUNKS * CHUNK // PAGE
    assert client.store(tokens, range(pages)) == len(tokens)
    torch.cuda.synchronize()
    stored = [t.view(torch.uint8)[:, :pages].clone() for t in kv]
    warm = lambda: first.stats()["tiers"]["host"]["warm"]  # noqa: E731
    wait_for(lambda: warm()["unsealed_shards"] == 0, 20, "the checksums of the stores")
    client.close()
    if how == "sigkill":
        first.kill()
    else:
        assert first.stop() == 0

    second = start_daemon(runtime_dir=first.runtime_dir, **KNOBS)
    host = lambda: second.stats()["tiers"]["host"]  # noqa: E731
    wait_for(lambda: host()["warm"]["verify"] in ("none", "done"), 60, "the verification")
    assert host()["warm"]["checksum_failures"] == 0, host()["warm"]
    assert host()["warm"]["start"] == ("crash" if how == "sigkill" else "clean"), host()["warm"]
    poisoned = tensors(fill=0xA5)
    client = engine(second, poisoned)
    assert client.lookup(tokens) == len(tokens)
    target = range(64, 64 + pages)  # other pages than the store's: a real copy, not a no-op
    assert client.load(tokens, target) == len(tokens)
    torch.cuda.synchronize()
    for got, want in zip(poisoned, stored):
        raw = got.view(torch.uint8)
        assert torch.equal(raw[:, 64:64 + pages], want), "loaded bytes differ from the stored"
        assert bool((raw[:, :64] == 0xA5).all()) and bool((raw[:, 64 + pages:] == 0xA5).all())
    client.close()
    assert second.stop() == 0
