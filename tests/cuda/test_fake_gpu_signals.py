"""The flag page on the fake GPU (tests/fakecuda): layer words, the done word, cancel, marks.

A real daemon runs kvd.cuda over the fake GPU, this process is the engine
(tests/cuda/conftest.py). The fake's streams run queued work on worker
threads, its ``cuStreamWaitValue32`` holds the engine's stream until the
daemon's stream writes the word, and its trace (fakecuda.trace) records
every kernel and flag-word write of the daemon in the order they ran.

- A layer-wise load writes layer 0..L-1's words, each after every kernel
  that scattered into that layer, then the done word, and nothing else; the
  engine's stream, waiting on each layer word, reads that layer's bytes
  already landed (kernels are slowed, so a word written early would be
  caught). Both the staged and the zero-copy path.
- A load the client gives up on (its deadline passes while the daemon's
  kernels are held back) is cancelled through the cancel word: the kernels
  run, read it, skip the engine's pages; the done word still follows, so
  the transfer is fenced, and not one byte of the engine's memory changed.
- A store whose KV the engine's stream writes after a long busy period is
  copied only once the stream got past the store's mark: the stored bytes
  are the new ones. On an idle engine stream neither a store nor a load
  queues a mark there: the stream ran everything before them already.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvd_client
from kvd_protocol.flags import FlagLayout

CHUNK = 16
PATHS = {"staged": {"gpu_stage_slot_bytes": "1MiB", "gpu_copy_path": "kernels"},
         "zero_copy": {"gpu_stage_slots": 0, "gpu_copy_path": "kernels"}}


def flag_writes(events: list, flags_path: str) -> list[tuple[int, int]]:
    """(word index, value) of every write the daemon made into this flag page, in order."""
    name = flags_path.rsplit("/", 1)[-1]
    return [(e["offset"] // 4, e["value"]) for e in events if e["ev"] == "write32" and e["region"] == name]


@pytest.mark.parametrize("path", sorted(PATHS))
def test_layerwise_load_signals_each_layer_then_done(fake_engine, fake_daemon, path):
    layers, chunks = 6, 4
    d = fake_daemon(kernel_delay_s={"kv_scatter": 0.05}, trace=True, **PATHS[path])
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", layers, 2 * chunks, 16, 8, 128)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        reg = client.register_kv(pool, model="layerwise")
        tokens = np.arange(chunks * CHUNK)
        src, dst = range(chunks), range(chunks, 2 * chunks)
        want = [t[:, :chunks].copy() for t in tensors]
        assert client.store(tokens, src) == chunks * CHUNK
        for t in tensors:
            t[:, chunks:] = 0x5A5A
        t = client.submit_load(tokens, dst, layerwise=True)
        seen = {}
        for layer in range(layers):
            client.wait_for_layer(layer, t)  # the engine's stream waits for the layer word
            pool.stream.launch(lambda layer=layer: seen.__setitem__(layer, tensors[layer][:, chunks:].copy()))
        assert t.wait(30).ok and t.tokens == chunks * CHUNK, t
        assert pool.stream.synchronize(timeout=10), "the engine's stream waits for a layer forever"
        for layer in range(layers):
            assert np.array_equal(seen[layer], want[layer]), f"layer {layer} read before it landed"
        flags = FlagLayout(layers, client.load_slots)
        writes = flag_writes(d.trace(), reg.flags.spec["path"])
        order = [flags.layer_word(t.slot, layer) for layer in range(layers)] + [flags.done_word(t.slot)]
        assert writes == [(w, t.seq) for w in order], writes
    events = d.trace()
    for layer in range(layers):  # each layer word after every kernel that wrote the layer
        word = next(i for i, e in enumerate(events) if e["ev"] == "write32"
                    and e["offset"] // 4 == flags.layer_word(t.slot, layer))
        kernels = [i for i, e in enumerate(events) if e["ev"] == "kernel" and e["name"] == "kv_scatter"
                   and e["layers"][0] <= layer < e["layers"][1]]
        assert kernels and max(kernels) < word, (layer, events)
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_cancelled_load_writes_nothing_into_the_pages(fake_engine, fake_daemon, path):
    d = fake_daemon(kernel_delay_s={"kv_scatter": 1.5}, trace=True, **PATHS[path])
    tensors, _, region = fake_engine.tensors("vllm_flash_attn", 2, 8, 16, 4, 64)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    tokens = np.arange(4 * CHUNK) + 3
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as storer:
        storer.register_kv(pool, model="cancel")
        assert storer.store(tokens, range(4)) == 4 * CHUNK
    for t in tensors:
        t[:, 4:] = 0x5A5A
    before = region.array.copy()
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), fence_quiet_s=20) as loader:
        reg = loader.register_kv(pool, model="cancel")
        loader.timeout = 0.3  # this load's deadline passes while its kernels are held back
        t = loader.submit_load(tokens, range(4, 8))
        assert t.wait(30).done and t.status == "failed", t  # fenced by the done word
        assert reg.flags.done(t.slot, t.seq)
    assert np.array_equal(region.array, before), "a cancelled load wrote into the engine's memory"
    scatters = [e for e in d.trace() if e["ev"] == "kernel" and e["name"] == "kv_scatter"]
    assert scatters and all(e["cancelled"] for e in scatters), scatters
    assert d.stop() == 0, d.log()


def test_store_waits_for_the_engine_stream(fake_engine, fake_daemon):
    """Data written on the engine's stream after a busy period is what gets stored."""
    d = fake_daemon()
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", 2, 8, 16, 4, 64)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    fresh = [np.random.default_rng(i).integers(0, 2**16, t.shape, dtype=np.uint16)
             for i, t in enumerate(tensors)]
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model="ordering")
        tokens = np.arange(4 * CHUNK)
        pool.stream.sleep(0.5)  # the forward pass is still running ...

        def forward_pass() -> None:  # ... and writes the KV only then
            for t, f in zip(tensors, fresh):
                t[...] = f
        pool.stream.launch(forward_pass)
        assert client.store(tokens, range(4)) == 4 * CHUNK
        for t in tensors:
            t[...] = 0
        assert client.load(tokens, range(4, 8)) == 4 * CHUNK
        for t, f in zip(tensors, fresh):
            assert np.array_equal(t[:, 4:8], f[:, 0:4]), "the store copied the KV before the engine wrote it"
    assert d.stop() == 0, d.log()


def test_an_idle_engine_stream_gets_no_mark(fake_engine, fake_daemon):
    """Marks are only queued where the engine's stream still has work before the request."""
    d = fake_daemon()
    tensors, _, _ = fake_engine.tensors("vllm_flash_attn", 2, 8, 16, 4, 64)
    pool = fake_engine.pool("vllm_flash_attn", tensors)
    with kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=True) as client:
        client.register_kv(pool, model="idle")
        tokens = np.arange(4 * CHUNK)
        pool.stream.synchronize()
        queued = pool.stream._queued
        assert client.store(tokens, range(4)) == 4 * CHUNK
        assert client.load(tokens, range(4, 8)) == 4 * CHUNK
        assert pool.stream._queued == queued, "a mark was queued on an idle stream"
        pool.stream.sleep(0.2)
        assert client.store(np.arange(4 * CHUNK) + 1, range(4)) == 4 * CHUNK
        assert pool.stream._queued == queued + 2, "a busy stream's store got no mark"
    assert d.stop() == 0, d.log()
