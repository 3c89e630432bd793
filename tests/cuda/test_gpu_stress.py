"""Many pipelined transfers from several engines on one GPU, with random kills.

Three engine processes keep up to 8 stores and loads in flight each, for
shared prompts whose KV bytes every engine derives from the prompt id. The
test SIGKILLs engines at random moments (starting replacements) and kills
and restarts the daemon once. Every load that ends ``ok`` is compared with
the prompt's bytes; every other load must end ``failed``, fenced, reported
by ``poll``. Surviving engines report their counts: no wrong byte anywhere,
loads verified, failures reported, nothing hung. Skipped without a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest
from gpu_env import require_gpu  # noqa: E402

torch = require_gpu()

pytestmark = pytest.mark.gpu
CHUNK = 64
SECONDS = 30.0


def _engine(runtime_dir: str, seed: int, seconds: float, q) -> None:
    import numpy as np
    import torch as t

    import kvd_client as kc
    from kvd_client.torch_pool import CudaKVPool
    layers, page, region = 4, 16, 8  # a region: 8 pages = 2 chunks
    kv = [t.zeros(2, 256, page, 4, 64, dtype=t.bfloat16, device="cuda") for _ in range(layers)]
    client = kc.KvdClient(runtime_dir=runtime_dir, timeout=10, fence_quiet_s=0.5).connect()
    client.register_kv(CudaKVPool("vllm_flash_attn", kv), model="stress")
    rng = random.Random(seed)

    def content(p: int):
        g = t.Generator(device="cuda").manual_seed(p)
        return t.randint(0, 256, (layers, 2, region, page, 4, 128), dtype=t.uint8, device="cuda",
                         generator=g)

    def view(r: int):
        return [x[:, r * region:(r + 1) * region].view(t.uint8) for x in kv]

    free = list(range(32))  # 16 source regions, 16 target regions
    busy, counts = {}, {"stored": 0, "loaded_ok": 0, "verified_chunks": 0, "failed": 0, "wrong": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end or busy:
        while len(busy) < 8 and free and time.monotonic() < end:
            r, p = free.pop(rng.randrange(len(free))), rng.randrange(48)
            tokens = np.arange(2 * CHUNK) + p * 10**6
            pages = range(r * region, (r + 1) * region)
            if rng.random() < 0.5:
                want = content(p)
                for layer, v in enumerate(view(r)):
                    v.copy_(want[layer].reshape(v.shape))  # the "forward pass" writes the KV
                tr = client.submit_store(tokens, pages)
            else:
                for v in view(r):
                    v.fill_(0xA5)
                tr = client.submit_load(tokens, pages, layerwise=rng.random() < 0.5)
                if tr.layerwise:
                    for layer in range(layers):
                        client.wait_for_layer(layer, tr)
            busy[id(tr)] = (tr, r, p)
        for tr in client.poll():
            _, r, p = busy.pop(id(tr))
            free.append(r)
            if tr.op == "store":
                counts["stored"] += tr.ok
            elif not tr.ok:
                counts["failed"] += 1
            else:
                counts["loaded_ok"] += 1
                n = tr.tokens // CHUNK
                t.cuda.synchronize()
                want, got = content(p), view(r)
                for layer in range(layers):
                    g = got[layer].reshape(want[layer].shape)[:, :n * 4]
                    counts["wrong"] += int(not t.equal(g, want[layer][:, :n * 4]))
                counts["verified_chunks"] += n
        time.sleep(0.001)
    client.close()
    q.put((seed, counts))


def test_pipelined_engines_with_random_kills(start_daemon):
    d = start_daemon(chunk_tokens=CHUNK, host_capacity="512MiB", gpu="on", client_timeout_s=2.0,
                     heartbeat_interval_s=0.2)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    rng = random.Random(7)
    engines, seed = [], 0

    def spawn(seconds: float):
        nonlocal seed
        seed += 1
        p = ctx.Process(target=_engine, args=(str(d.runtime_dir), seed, seconds, q))
        p.start()
        engines.append(p)

    for _ in range(3):
        spawn(SECONDS)
    t0 = time.monotonic()
    events = sorted(rng.uniform(5, SECONDS - 10) for _ in range(3))
    daemon_restart = rng.uniform(8, SECONDS - 8)
    killed = []
    for at in events:
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        victim = rng.choice([p for p in engines if p.is_alive() and p not in killed])
        os.kill(victim.pid, signal.SIGKILL)
        killed.append(victim)
        spawn(SECONDS - (time.monotonic() - t0))
    time.sleep(max(0.0, daemon_restart - (time.monotonic() - t0)))
    d.kill()
    d = start_daemon(runtime_dir=d.runtime_dir, chunk_tokens=CHUNK, host_capacity="512MiB",
                     gpu="on", client_timeout_s=2.0, heartbeat_interval_s=0.2)
    survivors = [p for p in engines if p not in killed]
    reports = [q.get(timeout=SECONDS + 120) for _ in survivors]
    for p in engines:
        p.join(30)
        if p in killed:
            for leftover in __import__("pathlib").Path("/dev/shm").glob(f"kvd-*-{p.pid}-*"):
                leftover.unlink()
    totals = {k: sum(c[k] for _, c in reports) for k in reports[0][1]}
    print("stress totals:", totals)
    assert totals["wrong"] == 0, totals
    assert totals["verified_chunks"] > 100 and totals["stored"] > 50, totals
    assert totals["failed"] > 0, "the daemon's kill failed no load: the test did not bite"
    assert d.stop() == 0, d.log()
