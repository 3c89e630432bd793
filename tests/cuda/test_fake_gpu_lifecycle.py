"""Engines dying and daemons stopping with copies in flight, on the fake GPU (tests/fakecuda).

- An engine (a spawned process on the fake GPU) is SIGKILLed while its load's
  kernels (or, on the DMA path, its batched copies, queued in steps of 4
  pages by the load thread, which waits for the window between steps, or by the event
  loop; or staged: 4 slots of 4 chunks) are held back on the daemon's streams: the daemon reaps it
  only after those copies ran, then closes its pool (the IPC mapping goes
  last: no copy touches the engine's memory after it, which the fake would
  report as an illegal address and a broken context), and serves the next
  engine bit-exact.
- With ``gpu_dma_store_thread``, an engine SIGKILLed while its stores are in
  the store thread's hands (one held on the copy engines, three queued
  behind it): reaped only after all four ran, its pool closed after them.
- The daemon gets SIGTERM while a fake stream is stuck (a kernel, or a store
  queued by the store thread, held for 20 s): it exits 0 within ``shutdown_grace_s`` + ``CLOSE_WAIT_S`` (plus
  slack), saying it left GPU copies queued, with the kernel never run.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from daemons import engine_killed_after, wait_reaped

import kvd_client
from kvd.cuda.devices import CLOSE_WAIT_S

CHUNK = 16
LAYERS = 4


def _engine(runtime_dir: str, layers: int) -> tuple:
    """In a spawned engine: a client with a fake-GPU pool of 64 pages registered, and the
    pool's memory region."""
    from fakecuda import driver, engine
    driver.install()
    tensors, _, region = engine.kv_tensors("vllm_flash_attn", layers, 64, 16, 8, 128, seed=1)
    pool = engine.FakeCudaKVPool("vllm_flash_attn", tensors)
    client = kvd_client.KvdClient(runtime_dir=runtime_dir, raise_errors=True, timeout=60).connect()
    client.register_kv(pool, model="dying")
    return client, region


def _dying_engine(runtime_dir: str, layers: int, conn) -> None:
    client, region = _engine(runtime_dir, layers)
    tokens = np.arange(16 * CHUNK)
    assert client.store(tokens, range(16)) == 16 * CHUNK
    time.sleep(0.1)  # staged only once the other direction has been idle (STAGE_IDLE_S)
    # 4 pieces (kernels), 4 steps of 4 pages = 1 MiB, a quarter of the window (DMA), or 4
    # slots of 4 chunks (staged DMA: 8 layers, 16 planes of 32 KiB pages), 0.4 s each
    client.submit_load(tokens, range(16, 32))
    conn.send((os.getpid(), region.name))
    time.sleep(120)


def _scattered(events: list, region: str) -> int:
    return len(_writes(events, region))


def _writes(events: list, region: str) -> list[int]:
    """Indices of the copies (scatter kernels, DMA batches) that wrote into ``region``."""
    return [i for i, e in enumerate(events) if region in e.get("regions", ())
            and (e["ev"] == "dma" or (e["ev"] == "kernel" and e["name"] == "kv_scatter"))]


DMA = {"gpu_copy_path": "dma", "gpu_dma_streams": 1, "gpu_dma_load_window": "4MiB"}
PATHS = {"kernels": (LAYERS, {"kv_scatter": 0.4}, {"gpu_copy_path": "kernels",
                                                   "gpu_stage_slot_bytes": "1MiB"}),
         "dma": (LAYERS, {"memcpy_batch": 0.4}, DMA),
         "dma, loop": (LAYERS, {"memcpy_batch": 0.4}, {**DMA, "gpu_dma_load_thread": "false"}),
         "staged dma": (8, {"memcpy_batch": 0.4}, {**DMA, "gpu_stage_slot_bytes": "2MiB",
                                                   "gpu_dma_stage_below": "64KiB"})}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_engine_killed_with_copies_in_flight_is_reaped_after_them(fake_engine, fake_daemon, path):
    layers, delay, knobs = PATHS[path]
    d = fake_daemon(kernel_delay_s=delay, trace=True, client_timeout_s=1.0,
                    heartbeat_interval_s=0.2, log_level="debug", **knobs)
    # killed once the first of four pieces landed: the load runs
    events, region, killed, closes = _killed_and_reaped(d, _dying_engine, layers, _scattered)
    touching = _writes(events, region)
    assert touching and max(touching) < closes[0], "a copy wrote into the pool after it was closed"
    assert any(events[i]["t"] > killed for i in touching), "no copy was in flight when it died"
    assert _scattered(events, region) == 4, "the load's copies did not all run"
    if path.startswith("dma"):
        by = {events[i]["queued_by"] for i in touching}
        assert by == {"MainThread" if "loop" in path else "kvd-dma0-load"}, by
    assert ("staged DMA:" in d.log()) == (path == "staged dma"), d.log()
    _survivor_round_trip(fake_engine, d)
    assert d.stop() == 0, d.log()


def _killed_and_reaped(d, engine, layers: int, started) -> tuple:
    """Spawn ``engine``, SIGKILL it once ``started(trace, region)`` holds, and wait until the
    daemon reaped it: the trace then, the engine's region, when it died, and where its pool
    was closed (``_closed_once``)."""
    with engine_killed_after(engine, str(d.runtime_dir), layers) as (pid, region):
        deadline = time.monotonic() + 30
        while not started(d.trace(), region):
            assert time.monotonic() < deadline, f"the copies did not start:\n{d.log()}"
            time.sleep(0.02)
    killed = time.monotonic()
    wait_reaped(d, 20)
    events = d.trace()
    return events, region, killed, _closed_once(events, region)


def _closed_once(events: list, region: str) -> list[int]:
    """Where the dead engine's pool was closed: once, or the test fails."""
    closes = [i for i, e in enumerate(events) if e["ev"] == "ipc_close" and e["region"] == region]
    assert len(closes) == 1, f"the dead engine's pool was not closed once: {events}"
    return closes


def _survivor_round_trip(fake_engine, d) -> None:
    """The next engine stores 4 pages and loads them into 4 others, bit-exact."""
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", LAYERS, 8, 16, 8, 128, seed=2)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(fake_engine.pool("vllm_flash_attn", tensors), model="survivor")
        want = [t[:, :4].copy() for t in tensors]
        assert client.store(np.arange(CHUNK * 4) + 9, range(4)) == 4 * CHUNK
        assert client.load(np.arange(CHUNK * 4) + 9, range(4, 8)) == 4 * CHUNK
        assert all(np.array_equal(t[:, 4:8], w) for t, w in zip(tensors, want))


def _storing_engine(runtime_dir: str, layers: int, conn) -> None:
    client, region = _engine(runtime_dir, layers)
    for k in range(4):  # each store one batch, held 0.4 s: three wait in the thread's queue
        client.submit_store(np.arange(4 * CHUNK) + k * 10**6, range(4 * k, 4 * k + 4))
    conn.send((os.getpid(), region.name))
    time.sleep(120)


def test_engine_killed_with_stores_in_the_store_threads_hands_is_reaped_after_them(
        fake_engine, fake_daemon):
    """``gpu_dma_store_thread``: the engine dies while its stores are queued by the thread,
    the first held on the copy engines; the pool closes only after all four ran."""
    d = fake_daemon(kernel_delay_s={"memcpy_batch": 0.4}, trace=True, client_timeout_s=1.0,
                    heartbeat_interval_s=0.2, **DMA, gpu_dma_store_thread="true")
    # killed once the first store's batch ran: the rest are queued
    events, region, killed, closes = _killed_and_reaped(d, _storing_engine, LAYERS,
                                                        lambda trace, _: _batches(trace))
    reads = _batches(events)  # all the dead engine's: the survivor comes after
    assert len(reads) == 4 and max(reads) < closes[0], "a store ran after the pool closed"
    assert {events[i]["queued_by"] for i in reads} == {"kvd-dma0"}
    assert any(events[i]["t"] > killed for i in reads), "no store was in flight when it died"
    _survivor_round_trip(fake_engine, d)
    assert "Traceback" not in d.log(), d.log()
    assert d.stop() == 0, d.log()


def _batches(events: list) -> list[int]:
    """Indices of the DMA batches that ran (the trace names what they wrote: a store's is
    the arena)."""
    return [i for i, e in enumerate(events) if e["ev"] == "dma"]


STUCK = {"kernels": ({"kv_gather": 20}, {}, "kernel"),
         "dma, store thread": ({"memcpy_batch": 20}, {**DMA, "gpu_dma_store_thread": "true"}, "dma")}


@pytest.mark.parametrize("path", sorted(STUCK))
def test_sigterm_is_bounded_while_a_stream_is_stuck(fake_engine, fake_daemon, path):
    grace, (delay, knobs, ev) = 1.0, STUCK[path]
    d = fake_daemon(kernel_delay_s=delay, trace=True, shutdown_grace_s=grace, **knobs)
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", 2, 8, 16, 4, 64)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    client = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), timeout=60).connect()
    try:
        client.register_kv(pool, model="stuck")
        t = client.submit_store(np.arange(4 * CHUNK), range(4))
        time.sleep(0.3)  # its gather kernel holds the store kernel stream
        assert not t.done
        t0 = time.monotonic()
        assert d.stop(signal.SIGTERM, timeout=15) == 0, d.log()
        took = time.monotonic() - t0
    finally:
        client.close()
    assert took < grace + CLOSE_WAIT_S + 3, f"SIGTERM took {took:.1f} s:\n{d.log()}"
    assert "GPU copies still queued" in d.log(), d.log()
    assert not [e for e in d.trace() if e["ev"] == ev], "the stuck copy was not stuck"
