"""The copy-engine-only path (``gpu_copy_path``, kvd.cuda.dma.path) on the fake GPU (tests/fakecuda).

A real daemon runs kvd.cuda over the fake GPU; this process is the engine
(tests/cuda/conftest.py). The fake's ``cuMemcpy3DBatchAsync_v2`` runs each
batch of pitched ops as one piece of queued work (held ``memcpy_batch`` seconds when the
test asks) and traces it. Bit-exact round trips for every layout are in
test_fake_gpu_copies.py; here:

- ``auto`` picks DMA for pages of at least ``gpu_dma_min_piece`` bytes and
  kernels below, and no kernel runs on the DMA path; head-strided pages
  (vLLM's GPU blocks, K and V side by side per head) always take kernels.
- A layer-wise load by DMA writes each layer's word after that layer
  landed (the engine's stream, waiting on each word, reads landed bytes
  while every batch is held back), then the done word, and nothing else.
- A cancelled load: a DMA cannot check the cancel word as a kernel does, so
  the daemon queues a load in steps (``gpu_dma_load_window`` = 1 byte: one
  run of pages, over all layers, per step) and checks the word on the host
  before each: after the cancel no further step is queued, the step queued
  before it lands, the done word follows.
- A driver that refuses pitched ops: each op alone, the refused ones row by
  row, the bytes exact.
- A driver that refuses a load's step as it is queued: the load fails, fenced
  by its done word only after the steps queued before it landed.
- Pitched pages under ``gpu_dma_stage_below`` go through the staging slots
  (copy engines inside the GPU, then whole chunks across), bit-exact, and a
  cancelled staged load stops after the slot it had queued; a copy while
  the other direction has copies queued goes straight instead.
- Consecutive page ids become one op per run, and planes at one pitch
  become that op's rows (fewer, longer DMAs).
- Copies of pieces under ``gpu_dma_spread_below`` are spread over
  ``gpu_dma_streams`` streams, larger ones go on one.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from test_fake_gpu_copies import store_then_load
from test_fake_gpu_signals import flag_writes

import kvd_client
from kvd.cuda.dma.path import STAGE_IDLE_S
from kvd_protocol.flags import FlagLayout

CHUNK = 16
DMA = {"gpu_copy_path": "dma", "gpu_dma_streams": 2}


@pytest.mark.parametrize("page_size, path", [(16, "DMA"), (1, "staged pieces")])
def test_auto_takes_dma_for_large_pages_only(fake_engine, fake_daemon, page_size, path):
    """Rows of 2 KiB and a threshold of 32 KiB: a page of 16 goes by DMA, a page of 1 not."""
    d = fake_daemon(log_level="debug", trace=True, gpu_stage_slot_bytes="1MiB",
                    gpu_dma_min_piece="32KiB")
    store_then_load(fake_engine, d, "vllm_flash_attn", page_size, seed=3)
    took = re.findall(r"(gather|scatter) of 8 chunks.* " + path, d.log())
    assert took == ["gather", "scatter"], d.log()
    kernels = [e for e in d.trace() if e["ev"] == "kernel"]
    assert (not kernels) == (path == "DMA"), kernels
    assert d.stop() == 0, d.log()


def test_dma_layerwise_load_signals_each_layer_after_it_landed(fake_engine, fake_daemon):
    layers, chunks = 5, 4
    d = fake_daemon(kernel_delay_s={"memcpy_batch": 0.05}, trace=True, gpu_dma_load_window=1,
                    **DMA)
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", layers, 2 * chunks, 16, 8, 128)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        reg = client.register_kv(pool, model="dma-layerwise")
        tokens = np.arange(chunks * CHUNK)
        want = [t[:, :chunks].copy() for t in tensors]
        assert client.store(tokens, range(chunks)) == chunks * CHUNK
        for t in tensors:
            t[:, chunks:] = 0x5A5A
        t = client.submit_load(tokens, range(chunks, 2 * chunks), layerwise=True)
        seen = {}
        for layer in range(layers):
            client.wait_for_layer(layer, t)
            pool.stream.launch(lambda layer=layer: seen.__setitem__(layer, tensors[layer][:, chunks:].copy()))
        assert t.wait(30).ok and t.tokens == chunks * CHUNK, t
        assert pool.stream.synchronize(timeout=10)
        for layer in range(layers):
            assert np.array_equal(seen[layer], want[layer]), f"layer {layer} read before it landed"
        flags = FlagLayout(layers, client.load_slots)
        order = [flags.layer_word(t.slot, layer) for layer in range(layers)] + [flags.done_word(t.slot)]
        assert flag_writes(d.trace(), reg.flags.spec["path"]) == [(w, t.seq) for w in order]
    assert not [e for e in d.trace() if e["ev"] == "kernel"]
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("layers, stage_below, step_pages", [(6, 0, 1), (8, "64KiB", 2)])
def test_dma_cancelled_load_queues_no_step_after_the_cancel(fake_engine, fake_daemon, layers,
                                                            stage_below, step_pages):
    """Straight (12 planes: no pitched ops, so never staged) a step is one run of pages
    over all layers; staged (16 planes of 32 KiB pages) a step is one slot of whole
    chunks (2 chunks of 512 KiB in a 1 MiB slot)."""
    d = fake_daemon(kernel_delay_s={"memcpy_batch": 0.5}, trace=True, gpu_dma_load_window=1,
                    gpu_copy_path="dma", gpu_dma_streams=1, gpu_stage_slot_bytes="1MiB",
                    gpu_dma_stage_below=stage_below, log_level="debug")
    tensors, _, region = fake_engine.tensors("vllm_flash_attn", layers, 8, 16, 8, 128)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    tokens = np.arange(4 * CHUNK) + 5
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as storer:
        storer.register_kv(pool, model="dma-cancel")
        assert storer.store(tokens, range(4)) == 4 * CHUNK
    for t in tensors:
        t[:, 4:] = 0x5A5A
    time.sleep(2 * STAGE_IDLE_S)  # right after a store, a load goes straight
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), fence_quiet_s=20) as loader:
        reg = loader.register_kv(pool, model="dma-cancel")
        loader.timeout = 0.3  # cancelled while the first step's copy is held back
        t = loader.submit_load(tokens, range(4, 8))
        assert t.wait(30).done and t.status == "failed", t  # fenced by the done word
        assert reg.flags.done(t.slot, t.seq)
    # one page per chunk, so a step (a quarter of the 1-byte window: at least one run)
    # is one page in every layer, or a slot's chunks: those landed everywhere, the rest nowhere
    k = step_pages
    landed = [np.array_equal(x[:, 4:4 + k], x[:, :k]) for x in tensors]
    untouched = [bool((x[:, 4 + k:] == 0x5A5A).all()) for x in tensors]
    assert all(landed) and all(untouched), (landed, untouched)
    loads = [e for e in d.trace() if e["ev"] == "dma" and region.name in e["regions"]]
    assert len(loads) == 1, loads
    how = "staged DMA" if stage_below else "DMA"
    assert re.findall(r"(gather|scatter) of 4 chunks, [\d.]+ MB, ([a-zA-Z ]+):", d.log()) == [
        ("gather", how), ("scatter", how)], d.log()
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("stage_below, how", [("64KiB", "staged DMA"), (0, "DMA"),
                                               (None, "DMA")])
def test_small_pitched_pages_go_through_the_staging_slots(fake_engine, fake_daemon, stage_below,
                                                          how):
    """32 KiB pages in ops of 16 planes (8 layers in one allocation), under
    gpu_dma_stage_below: the copy engines gather them into staging slots by pitched
    device-to-device ops and whole chunks cross to the arena by memcpy (2 chunks per 1 MiB
    slot, so several pieces), and back the same way: bit-exact, nothing else in the pool
    written, no kernel. 0 turns staging off: pitched ops straight to the arena; so does
    the default (None: the knob unset), as staging costs the engines their GPU time."""
    knob = {} if stage_below is None else {"gpu_dma_stage_below": stage_below}
    d = fake_daemon(log_level="debug", trace=True, gpu_copy_path="dma", gpu_dma_streams=2,
                    gpu_stage_slot_bytes="1MiB", **knob)
    chunks, pages = 5, 13
    tensors, _, region = fake_engine.tensors("vllm_flash_attn", 8, pages, 16, 8, 128, seed=4)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    src, dst = [5, 0, 9, 2, 11], [1, 10, 3, 7, 12]
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model="staged")
        tokens = np.arange(chunks * CHUNK) + 3
        want = [t[:, src].copy() for t in tensors]
        assert client.store(tokens, src) == chunks * CHUNK
        for t in tensors:
            t[:, dst] = 0x5A5A
        before = region.array.copy()
        time.sleep(2 * STAGE_IDLE_S)  # right after a store, a load goes straight
        assert client.load(tokens, dst) == chunks * CHUNK
        assert all(np.array_equal(t[:, dst], w) for t, w in zip(tensors, want))
        for t in tensors:
            t[:, dst] = 0x5A5A
        assert np.array_equal(region.array, before)
    took = re.findall(r"(gather|scatter) of 5 chunks, [\d.]+ MB, ([a-zA-Z ]+):", d.log())
    assert took == [("gather", how), ("scatter", how)], d.log()
    assert not [e for e in d.trace() if e["ev"] == "kernel"]
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("layers, copies", [(2, 4 * 4), (8, 4)])
def test_consecutive_pages_are_one_copy_each_run(fake_engine, fake_daemon, layers, copies):
    """4 chunks of 1-token pages at consecutive ids: one copy per chunk and plane of the
    chunk's 16 tokens (the canonical shards of a request are adjacent in the arena only by
    chance), not 16 one-token copies; with at least MIN_ROWS (16) planes at one pitch (the
    fake allocates the layers' tensors back to back) one pitched op per chunk whose rows
    are the planes. A load this small is one step, so one batch each way."""
    d = fake_daemon(trace=True, gpu_copy_path="dma", gpu_dma_streams=1)
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", layers, 64, 1, 8, 128, seed=9)
    pool = fake_engine.pool("vllm_flash_attn", tensors, 1)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model="runs")
        tokens = np.arange(4 * CHUNK) + 11
        want = [t[:, :64].copy() for t in tensors]
        assert client.store(tokens, range(64)) == 4 * CHUNK
        for t in tensors:
            t[...] = 0x5A5A
        assert client.load(tokens, range(64)) == 4 * CHUNK
        assert all(np.array_equal(t[:, :64], w) for t, w in zip(tensors, want))
    batches = [e for e in d.trace() if e["ev"] == "dma"]
    store, load = batches[0], batches[-1]
    assert len(batches) == 2 and store["pieces"] == load["pieces"] == copies, batches
    assert d.stop() == 0, d.log()


def test_refused_pitched_ops_go_row_by_row(fake_engine, fake_daemon):
    """A driver that refuses pitched ops of more than 2 rows (the fake's planes sit at one
    pitch, so ops have 16): each op is tried alone, the refused ones go row by row in the
    same stream order, a warning says so once per direction, and the bytes are exact."""
    d = fake_daemon(max_3d_rows=2, trace=True, **DMA)
    store_then_load(fake_engine, d, "vllm_flash_attn", 16, seed=5)
    warned = d.log().count("the driver refused pitched copies")
    assert warned == 2, d.log()
    assert not [e for e in d.trace() if e["ev"] == "kernel"]
    assert d.stop() == 0, d.log()


def test_a_store_while_a_load_is_queued_goes_straight(fake_engine, fake_daemon):
    """Staging only pays one way at a time: a store that arrives while another engine's
    staged load is still on the copy engines (held 0.5 s) goes by straight pitched ops, as
    does a load right after a store; once the other way has been idle for STAGE_IDLE_S a
    copy is staged again. Bytes exact."""
    d = fake_daemon(log_level="debug", kernel_delay_s={"memcpy_batch": 0.5}, gpu_copy_path="dma",
                    gpu_dma_streams=1, gpu_dma_stage_below="64KiB")
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", 8, 12, 16, 8, 128, seed=6)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    runtime = str(d.runtime_dir)
    with kvd_client.KvdClient(runtime_dir=runtime, raise_errors=True) as a, \
            kvd_client.KvdClient(runtime_dir=runtime, raise_errors=True) as b:
        a.register_kv(pool, model="both-ways")
        b.register_kv(pool, model="both-ways")
        first, second, third = (np.arange(2 * CHUNK) + k * 1000 for k in range(3))
        want = [t[:, [0, 1]].copy() for t in tensors]
        assert a.store(first, [0, 1]) == 2 * CHUNK
        time.sleep(2 * STAGE_IDLE_S)
        load = a.submit_load(first, [4, 5])
        time.sleep(0.2)  # the load's fill is held on the copy engines
        assert b.store(second, [2, 3]) == 2 * CHUNK
        assert load.wait(30).ok and load.tokens == 2 * CHUNK, load
        assert all(np.array_equal(t[:, [4, 5]], w) for t, w in zip(tensors, want))
        assert b.store(third, [6, 7]) == 2 * CHUNK
        assert b.load(second, [8, 9]) == 2 * CHUNK  # right after a store: straight
        time.sleep(2 * STAGE_IDLE_S)
        assert b.load(third, [10, 11]) == 2 * CHUNK
        assert all(np.array_equal(t[:, [8, 9]], t[:, [2, 3]]) for t in tensors)
        assert all(np.array_equal(t[:, [10, 11]], t[:, [6, 7]]) for t in tensors)
    took = re.findall(r"(gather|scatter) of 2 chunks, [\d.]+ MB, ([a-zA-Z ]+):", d.log())
    assert took == [("gather", "staged DMA"), ("scatter", "staged DMA"), ("gather", "DMA"),
                    ("gather", "staged DMA"), ("scatter", "DMA"), ("scatter", "staged DMA")], \
        d.log()  # in the order they landed
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("spread_below, batches", [("1MiB", 2 * 3), ("1KiB", 2), ("0", 2)])
def test_small_pieces_spread_over_the_streams_large_ones_take_one(fake_engine, fake_daemon,
                                                                 spread_below, batches):
    """Pages of a few KiB: under ``gpu_dma_spread_below`` each copy is spread over the 3
    streams (one batch per stream, a store and a load), at or over it each copy is one
    batch on one stream; bytes exact either way."""
    d = fake_daemon(trace=True, gpu_copy_path="dma", gpu_dma_streams=3,
                    gpu_dma_spread_below=spread_below)
    store_then_load(fake_engine, d, "vllm_flash_attn", 16, seed=4)
    assert len([e for e in d.trace() if e["ev"] == "dma"]) == batches, d.trace()
    assert d.stop() == 0, d.log()


def test_a_load_refused_part_way_through_queuing_is_fenced_after_what_was_queued(
        fake_engine, fake_daemon):
    """The driver refuses a load's second step as the daemon queues it (pitched ops refused,
    so every step is one batch of rows; the third such batch of the process: the store's
    was the first), while the first step is still held back on the copy engines. The load
    fails, but its done word (the client's fence) comes only after that first step
    landed: a release from the host would let the engine reuse pages a queued copy still
    writes. Nothing else moved, the chunks stay cached, and the daemon serves on."""
    d = fake_daemon(kernel_delay_s={"memcpy_batch": 0.3}, max_3d_rows=2, fail_row_batch=3,
                    trace=True, gpu_copy_path="dma", gpu_dma_streams=1,
                    gpu_dma_load_window="1MiB")  # steps of one page over all layers
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", 6, 12, 16, 8, 128, seed=9)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    tokens = np.arange(4 * CHUNK) + 11
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), fence_quiet_s=20) as client:
        reg = client.register_kv(pool, model="dma-refused")
        assert client.store(tokens, range(4)) == 4 * CHUNK
        for t in tensors:
            t[:, 4:] = 0x5A5A
        t = client.submit_load(tokens, range(4, 8))
        assert t.wait(30).done and t.status == "failed", t
        assert reg.flags.done(t.slot, t.seq)
        first = [np.array_equal(x[:, 4], x[:, 0]) for x in tensors]
        untouched = [bool((x[:, 5:] == 0x5A5A).all()) for x in tensors]
        assert all(first) and all(untouched), (first, untouched)  # step 1 landed, then the fence
        assert client.load(tokens, range(8, 12)) == 4 * CHUNK  # cached, and served
        assert all(np.array_equal(x[:, 8:12], x[:, 0:4]) for x in tensors)
    assert "copy failed: CudaExportError('cuMemcpyBatchAsync failed" in d.log(), d.log()
    assert d.stop() == 0, d.log()
