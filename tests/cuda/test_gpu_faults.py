"""No process's death hangs another, on the GPU: real engines, a real daemon, real kills.

- An engine dies (exits, or is SIGKILLed) while its store waits behind a long
  kernel on its stream: another engine on the same GPU stores and loads
  within ``client_timeout_s`` + 2 s, bytes verified; the daemon stops on
  SIGTERM within its grace period afterwards.
- The daemon is SIGKILLed while a layer-wise load (and, separately, a plain
  load) is being copied: the client notices within ``NOTICE_S`` of the
  daemon's end and the engine's stream resumes within ``RELEASE_S`` of the
  SIGKILL (an event recorded after the waits of every layer completes; the
  figures are printed, ``-s``), the load is reported failed, and a
  restarted daemon serves the same engine without restarting it.
Skipped without torch, cupy or a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import time

import numpy as np
import pytest
from gpu_env import require_gpu  # noqa: E402

torch = require_gpu()

import kvd_client  # noqa: E402
from kvd_client.torch_pool import CudaKVPool  # noqa: E402

pytestmark = pytest.mark.gpu
CHUNK = 64
NOTICE_S = 0.2   # the client probes the daemon's lock every 50 ms while requests wait
RELEASE_S = 1.0  # SIGKILL to the engine's stream resuming (H200: 0.14-0.42 s, docs/gpu.md)
KNOBS = {"chunk_tokens": CHUNK, "host_capacity": "1GiB", "gpu": "on", "client_timeout_s": 2.0,
         "heartbeat_interval_s": 0.2, "shutdown_grace_s": 8.0}


def tensors(layers=2, pages=64, page=16, heads=4, dim=64, one_allocation=False, vmm=False):
    """Per-layer KV tensors, each its own allocation or views of one (vLLM's), or in CUDA
    virtual memory, a segment per layer, shared by file descriptor (vLLM 0.34's)."""
    if vmm:
        from kvd.bench.vmm_pool import vmm_layers
        shape = (2, pages, page, heads, dim * 2)
        return [t.random_(0, 256).view(shape).view(torch.bfloat16)
                for t in vmm_layers(torch, int(np.prod(shape)), layers)]
    if one_allocation:
        whole = torch.randint(0, 256, (layers, 2, pages, page, heads, dim * 2), dtype=torch.uint8,
                              device="cuda").view(torch.bfloat16)
        return list(whole.unbind(0))
    return [torch.randint(0, 256, (2, pages, page, heads, dim * 2), dtype=torch.uint8,
                          device="cuda").view(torch.bfloat16) for _ in range(layers)]


def _dying_engine(runtime_dir: str, how: str, q, vmm: bool = False) -> None:
    import torch as t

    import kvd_client as kc
    from kvd_client.torch_pool import CudaKVPool as Pool
    kv = [t.ones(2, 64, 16, 4, 64, dtype=t.bfloat16, device="cuda") for _ in range(2)]
    if vmm:
        kv = tensors(vmm=True)
    client = kc.KvdClient(runtime_dir=runtime_dir, raise_errors=True, timeout=30).connect()
    client.register_kv(Pool("vllm_flash_attn", kv), model="shared-gpu")
    t.cuda.synchronize()
    t.cuda._sleep(4_000_000_000)  # seconds of GPU time: the store's mark comes after it
    transfer = client.submit_store(np.arange(4 * CHUNK) + 5, range(16))
    q.send(("waiting", os.getpid(), transfer.status))  # a pipe: sent before we return
    if how == "exit":
        os._exit(0)  # the context goes away with the kernel still running
    time.sleep(120)


@pytest.mark.parametrize("how", ["exit", "sigkill", "sigkill, vmm"])
def test_dead_engine_with_a_waiting_store_hangs_nobody(start_daemon, how):
    d = start_daemon(**KNOBS)
    ctx = multiprocessing.get_context("spawn")
    q, child = ctx.Pipe(duplex=False)
    vmm = how.endswith("vmm")
    how = how.split(",")[0]
    dying = ctx.Process(target=_dying_engine, args=(str(d.runtime_dir), how, child, vmm))
    dying.start()
    assert q.poll(120), "the engine did not start"
    kind, pid, status = q.recv()
    assert (kind, status) == ("waiting", "pending")
    time.sleep(0.3)
    if how == "sigkill":
        os.kill(pid, signal.SIGKILL)
    dying.join(30)
    kv = tensors()
    t0 = time.monotonic()
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True, timeout=10) as c:
        c.register_kv(CudaKVPool("vllm_flash_attn", kv), model="shared-gpu")
        tokens = np.arange(4 * CHUNK) + 999
        want = [x[:, 0:16].clone() for x in kv]
        torch.cuda.synchronize()
        assert c.store(tokens, range(16)) == 4 * CHUNK
        for x in kv:
            x[:, 16:32].view(torch.uint8).fill_(0xA5)
        assert c.load(tokens, range(16, 32)) == 4 * CHUNK
        torch.cuda.synchronize()
        assert all(torch.equal(x[:, 16:32].view(torch.uint8), w.view(torch.uint8))
                   for x, w in zip(kv, want))
    assert time.monotonic() - t0 < KNOBS["client_timeout_s"] + 2
    deadline = time.monotonic() + KNOBS["client_timeout_s"] + 5
    while (stats := d.stats())["clients"]:  # the dead engine is reaped, its store undone
        assert time.monotonic() < deadline, f"the dead engine was not reaped:\n{d.log()}"
        time.sleep(0.1)
    assert stats["tiers"]["host"]["entries"] == stats["tiers"]["host"]["chunks"]
    t1 = time.monotonic()
    assert d.stop(signal.SIGTERM, timeout=30) == 0, d.log()
    assert time.monotonic() - t1 < 10


@pytest.mark.parametrize("when,layerwise,pool", [
    ("queued", True, "per-layer"), ("queued", False, "per-layer"), ("copying", True, "per-layer"),
    ("copying", False, "per-layer"), ("queued", False, "one"), ("copying", False, "one"),
    ("copying", False, "one, staged"), ("copying", True, "vmm"), ("queued", False, "vmm")])
def test_killed_daemon_releases_the_engine_and_a_new_one_serves_it(start_daemon, when, layerwise,
                                                                   pool):
    """``queued``: the daemon is stopped (SIGSTOP) when the load arrives and killed with the
    load unanswered; ``copying``: killed a few milliseconds into a 1 GiB load (it may have
    finished: then its bytes must be right). ``per-layer`` pools take kernels (DMA where the
    allocator spaced the layers evenly); ``one`` allocation for all layers (32 planes of 32 KiB
    pages) takes pitched DMA, and with
    ``gpu_dma_stage_below`` above its pages, staged DMA; ``vmm``: virtual memory lent by file
    descriptor, lent again to the restarted daemon."""
    knobs = {**KNOBS, "host_capacity": "2GiB", "log_level": "debug",
             **({"gpu_dma_stage_below": "64KiB"} if pool == "one, staged" else {})}
    d = start_daemon(**knobs)
    layers, pages = 16, 512
    kv = tensors(layers, pages, 16, 8, 128, pool != "per-layer", vmm=pool == "vmm")  # 512 MiB
    client = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), timeout=10,
                                  fence_quiet_s=0.5).connect()
    try:
        client.register_kv(CudaKVPool("vllm_flash_attn", kv), model="phoenix-gpu")
        tokens = np.arange(64 * CHUNK)  # 64 chunks of 4 pages: pages 0..255
        want = [x[:, 0:256].clone() for x in kv]
        torch.cuda.synchronize()
        assert client.store(tokens, range(256)) == 64 * CHUNK
        time.sleep(0.1)  # a staged pool's load goes staged (the other direction idle)
        if when == "queued":
            d.proc.send_signal(signal.SIGSTOP)
        t = client.submit_load(tokens, range(256, 512), layerwise=layerwise)
        if layerwise:
            for layer in range(layers):
                client.wait_for_layer(layer, t)
        after = torch.cuda.Event()
        after.record(torch.cuda.current_stream())  # ordered after every layer's wait
        time.sleep(0.3 if when == "queued" else 0.003)
        assert when == "copying" or not t.done
        sent = time.monotonic()
        d.kill()  # returns once the process is gone (reaped)
        reaped = time.monotonic() - sent
        noticed = released = None
        while noticed is None or released is None:
            now = time.monotonic() - sent
            assert now < client.timeout, f"the engine's stream is stuck: {t}"
            if noticed is None and t.status != "pending":  # failed (or it had landed)
                noticed = now
            if released is None and after.query():
                released = now
            time.sleep(0.001)
        print(f"daemon SIGKILL ({when}, layerwise={layerwise}, {pool}): reaped after "
              f"{reaped:.3f} s, the client noticed after {noticed:.3f} s, the engine's stream "
              f"resumed after {released:.3f} s")
        assert noticed - reaped < NOTICE_S, "the client noticed the dead daemon late"
        assert released < RELEASE_S, "the engine's stream resumed late"
        t.wait(30)
        assert t.done, t
        if t.ok:
            assert when == "copying"
            torch.cuda.synchronize()
            assert all(torch.equal(x[:, 256:512].view(torch.uint8), w.view(torch.uint8))
                       for x, w in zip(kv, want))
        else:
            assert isinstance(t.error, kvd_client.DaemonUnavailable), t
        x = torch.ones(1024, device="cuda")
        assert float((x * 2).sum()) == 2048.0  # the engine's GPU work goes on
        d2 = start_daemon(runtime_dir=d.runtime_dir, **knobs)
        deadline = time.monotonic() + 20
        while client.store(tokens[:4 * CHUNK], range(16)) != 4 * CHUNK:
            assert time.monotonic() < deadline, "the client did not come back"
            time.sleep(0.1)
        for x in kv:
            x[:, 16:32].view(torch.uint8).fill_(0x5A)
        time.sleep(0.1)  # staged once the other direction has been idle (STAGE_IDLE_S)
        assert client.load(tokens[:4 * CHUNK], range(16, 32)) == 4 * CHUNK
        torch.cuda.synchronize()
        assert all(torch.equal(x[:, 16:32].view(torch.uint8), w[:, 0:16].view(torch.uint8))
                   for x, w in zip(kv, want))
        assert d2.stats()["registrations"] == 1
        # per-layer tensors the allocator happened to space evenly are one pitched group,
        # which goes by DMA (seen on an H200); spaced otherwise, by kernels in staged pieces
        how = {"per-layer": "(DMA|\\d+ staged pieces)", "one": "DMA", "one, staged": "staged DMA",
               "vmm": "(DMA|\\d+ staged pieces)"}[pool]
        assert re.search(f"scatter of 4 chunks, 16.8 MB, {how}:", d2.log()), d2.log()
    finally:
        client.close()
