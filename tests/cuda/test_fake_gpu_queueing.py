"""How many copies of one engine the daemon queues on a GPU (kvd.server.copy_gate), fake GPU.

A real daemon over the fake GPU (tests/cuda/conftest.py) holds every DMA
batch ``HOLD_S`` on its one stream per direction, so a copy's "landed after"
(debug log: from the moment it was queued) says how many copies were queued
ahead of it. An engine alone on the GPU gets its next store queued while one
runs (``max_queued_copies_alone``, 2): some store waited behind another of
its own, about two holds. Two engines storing at once each get the fair
share (``max_queued_copies``, 1): no store ever waits behind more than one
other (about two holds, never three or four). The bytes land exact.
"""

from __future__ import annotations

import re

import numpy as np

import kvd_client

CHUNK = 16
HOLD_S = 0.5
DMA = {"gpu_copy_path": "dma", "gpu_dma_streams": 1, "gpu_dma_stage_below": 0,
       "kernel_delay_s": {"memcpy_batch": HOLD_S}, "log_level": "debug"}


def landed_after(log: str) -> list[float]:
    return [float(s) / 1e3 for s in re.findall(r"gather of 1 chunks, .*landed after ([\d.]+) ms", log)]


def store_pipelined(client, first_page: int, token_base: int, n: int = 3) -> list:
    return [client.submit_store(np.arange(CHUNK) + token_base + k * 1000, [first_page + k])
            for k in range(n)]


def test_an_engine_alone_has_its_next_store_queued(fake_engine, fake_daemon):
    d = fake_daemon(**DMA)
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", 4, 8, 16, 8, 128, seed=8)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as c:
        c.register_kv(pool, model="alone")
        stores = store_pipelined(c, 0, 0)
        assert all(s.wait(30).ok for s in stores), stores
        back = [c.submit_load(np.arange(CHUNK) + k * 1000, [4 + k]) for k in range(3)]
        assert all(t.wait(30).ok and t.tokens == CHUNK for t in back), back
    assert all(np.array_equal(t[:, 4 + k], t[:, k]) for t in tensors for k in range(3))
    took = landed_after(d.log())
    assert len(took) == 3 and max(took) > 1.6 * HOLD_S, (took, d.log())
    assert d.stop() == 0, d.log()


def test_two_engines_storing_at_once_get_one_copy_each(fake_engine, fake_daemon):
    d = fake_daemon(**DMA)
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", 4, 8, 16, 8, 128, seed=9)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    runtime = str(d.runtime_dir)
    with kvd_client.KvdClient(runtime_dir=runtime, raise_errors=True) as a, \
            kvd_client.KvdClient(runtime_dir=runtime, raise_errors=True) as b:
        a.register_kv(pool, model="two")
        b.register_kv(pool, model="two")
        stores = store_pipelined(a, 0, 0) + store_pipelined(b, 4, 10**6)
        assert all(s.wait(60).ok for s in stores), stores
    took = landed_after(d.log())
    assert len(took) == 6, d.log()
    assert max(took) < 2.8 * HOLD_S, (took, d.log())  # behind one other copy, never two
    assert max(took) > 1.6 * HOLD_S, took             # but they did share the queue
    assert d.stop() == 0, d.log()
