"""How many copies of one engine the daemon queues on a GPU (kvd.server.copy_gate), fake GPU.

A real daemon over the fake GPU (tests/cuda/conftest.py) holds every DMA
batch ``HOLD_S`` on its one stream per direction, so a copy's "landed after"
(debug log: from the moment it was queued) says how many copies were queued
ahead of it. An engine alone on the GPU gets its next store queued while one
runs (``max_queued_copies_alone``, 2): some store waited behind another of
its own, about two holds; small stores beyond those two while they total at
most ``max_queued_bytes_alone`` (0 here but in its own test). Two engines storing at once each get the fair
share (``max_queued_copies``, 1): no store ever waits behind more than one
other (about two holds, never three or four). The bytes land exact.
"""

from __future__ import annotations

import re
import time

import numpy as np
from daemons import engine_killed_after, wait_for, wait_reaped

import kvd_client

CHUNK = 16
HOLD_S = 0.5
DMA = {"gpu_copy_path": "dma", "gpu_dma_streams": 1, "gpu_dma_stage_below": 0,
       "kernel_delay_s": {"memcpy_batch": HOLD_S}, "log_level": "debug",
       "max_queued_bytes_alone": 0}


def landed_after(log: str) -> list[float]:
    return [float(s) / 1e3 for s in re.findall(r"gather of 1 chunks, .*landed after ([\d.]+) ms", log)]


def store_pipelined(client, first_page: int, token_base: int, n: int = 3) -> list:
    return [client.submit_store(np.arange(CHUNK) + token_base + k * 1000, [first_page + k])
            for k in range(n)]


def store_three_alone(fake_engine, d, seed: int) -> list[float]:
    """One engine stores three chunks pipelined and loads them back bit-exact; returns each
    store's "landed after" (seconds)."""
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", 4, 8, 16, 8, 128, seed=seed)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as c:
        c.register_kv(pool, model=f"alone-{seed}")
        stores = store_pipelined(c, 0, 0)
        assert all(s.wait(30).ok for s in stores), stores
        back = [c.submit_load(np.arange(CHUNK) + k * 1000, [4 + k]) for k in range(3)]
        assert all(t.wait(30).ok and t.tokens == CHUNK for t in back), back
    assert all(np.array_equal(t[:, 4 + k], t[:, k]) for t in tensors for k in range(3))
    return landed_after(d.log())


def test_an_engine_alone_has_its_next_store_queued(fake_engine, fake_daemon):
    d = fake_daemon(**DMA)
    took = store_three_alone(fake_engine, d, seed=8)
    assert len(took) == 3 and 1.6 * HOLD_S < max(took) < 2.6 * HOLD_S, (took, d.log())
    assert d.stop() == 0, d.log()


def test_an_engine_alone_queues_small_stores_up_to_the_byte_limit(fake_engine, fake_daemon):
    """Three stores of 256 KiB under a 1 MiB ``max_queued_bytes_alone``: all three are
    queued at once, so the last waits behind two of its own (about three holds)."""
    d = fake_daemon(**{**DMA, "max_queued_bytes_alone": "1MiB"})
    took = store_three_alone(fake_engine, d, seed=10)
    assert len(took) == 3 and max(took) > 2.6 * HOLD_S, (took, d.log())
    assert d.stop() == 0, d.log()


def wait_queued(d, name: str) -> None:
    """Until the client ``name`` has a copy queued (``kvd stats``)."""
    wait_for(lambda: sum(s["copies_queued"] for s in d.stats()["sessions"] if s["name"] == name),
             10, f"a copy of {name} queued", interval=0.01)


def test_two_engines_storing_at_once_get_one_copy_each(fake_engine, fake_daemon):
    """b has a store queued before a starts, a has one before b sends more: from then on
    each gets the fair share, so no store waits behind more than one other (about two
    holds; three if either had two)."""
    d = fake_daemon(**DMA)
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", 4, 8, 16, 8, 128, seed=9)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    runtime = str(d.runtime_dir)
    with kvd_client.KvdClient(runtime_dir=runtime, raise_errors=True, name="a") as a, \
            kvd_client.KvdClient(runtime_dir=runtime, raise_errors=True, name="b") as b:
        a.register_kv(pool, model="two")
        b.register_kv(pool, model="two")
        stores = [b.submit_store(np.arange(CHUNK) + 10**7, [7])]
        wait_queued(d, "b")
        stores += store_pipelined(a, 0, 0)
        wait_queued(d, "a")
        stores += store_pipelined(b, 4, 10**6, n=2)
        assert all(s.wait(60).ok for s in stores), stores
    took = landed_after(d.log())
    assert len(took) == 6, d.log()
    assert max(took) < 2.6 * HOLD_S, (took, d.log())  # behind one other copy, never two
    assert max(took) > 1.6 * HOLD_S, took             # but they did share the queue
    assert d.stop() == 0, d.log()


def _dying_engine(runtime_dir: str, conn) -> None:
    from fakecuda import driver, engine
    driver.install()
    tensors, _, region = engine.kv_tensors("vllm_flash_attn", 4, 8, 16, 8, 128, seed=1)
    pool = engine.FakeCudaKVPool("vllm_flash_attn", tensors)
    client = kvd_client.KvdClient(runtime_dir=runtime_dir, raise_errors=True, timeout=60).connect()
    client.register_kv(pool, model="dying")
    store_pipelined(client, 0, 0)
    conn.send(region.name)
    time.sleep(120)


def test_engine_killed_with_two_copies_queued_and_one_at_the_gate(fake_engine, fake_daemon):
    """SIGKILL while the engine has two stores queued (``copies_queued`` 2 in ``kvd stats``)
    and a third waiting at the gate: the daemon queues the third once a slot frees, reaps
    the engine only after all three landed, closes its pool after them, counts nothing
    queued afterwards, and serves the next engine bit-exact."""
    d = fake_daemon(**DMA, trace=True, client_timeout_s=1.0, heartbeat_interval_s=0.2)
    with engine_killed_after(_dying_engine, str(d.runtime_dir)) as region:
        wait_for(lambda: [s["copies_queued"] for s in d.stats()["sessions"]] == [2], 30,
                 "two copies queued")
    stats = wait_reaped(d, 30)
    assert stats["copies_queued"] == 0 and not stats["sessions"], stats
    events = d.trace()
    closes = [i for i, e in enumerate(events) if e["ev"] == "ipc_close" and e["region"] == region]
    assert len(closes) == 1, events
    stores = [e for e in events[:closes[0]] if e["ev"] == "dma"]  # a store writes the arena
    assert len(stores) == 3, events  # the one at the gate too, all before the pool closed
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", 4, 8, 16, 8, 128, seed=2)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as c:
        c.register_kv(pool, model="survivor")
        assert c.store(np.arange(CHUNK) + 7, [0]) == CHUNK
        assert c.load(np.arange(CHUNK) + 7, [1]) == CHUNK
    assert all(np.array_equal(t[:, 1], t[:, 0]) for t in tensors)
    assert d.stats()["copies_queued"] == 0
    assert d.stop() == 0, d.log()
