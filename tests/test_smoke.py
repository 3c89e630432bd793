"""First contact through a real daemon: one engine registers a shared-memory pool, stores,
looks up and loads chunks back bit-exact into other pages (replies waited for, then
busy-polled), and the daemon's stats count them; a store whose copy completes after the
client's deadline is discarded, not kept."""

import numpy as np
import pytest

import kvd_client


@pytest.mark.parametrize("spin_s", [0.0, 0.05])  # 0.05: replies are busy-polled for
def test_store_lookup_load_roundtrip(daemon, spin_s):
    with kvd_client.KvdClient(runtime_dir=str(daemon.runtime_dir), raise_errors=True,
                              spin_s=spin_s) as client:
        pool = kvd_client.SharedKVPool("vllm_flash_attn", 2, 64, 4, 2, 8, "float16")
        pool.raw[:] = np.random.default_rng(1).integers(0, 256, pool.raw.size, dtype=np.uint8)
        client.register_kv(pool, model="smoke")
        tokens = np.arange(40)
        assert client.lookup(tokens) == 0
        assert client.store(tokens, np.arange(8)) == 32
        assert client.lookup(tokens) == 32
        assert client.load(tokens, np.arange(8, 16)) == 32
        for t in pool.tensors:
            raw = t.view(np.uint8)
            assert (raw[:, 8:16] == raw[:, 0:8]).all()
        pool.close()
    stats = daemon.stats()
    assert stats["tiers"]["host"]["chunks"] == 2
    assert stats["hits"] == 2 and stats["misses"] == 2


def test_store_completing_after_the_deadline_is_discarded(daemon):
    from kvd_protocol import wire
    from kvd_protocol.errors import DeadlineExceeded
    with kvd_client.KvdClient(runtime_dir=str(daemon.runtime_dir), raise_errors=True) as client:
        pool = kvd_client.SharedKVPool("vllm_flash_attn", 2, 64, 4, 2, 8, "float16")
        reg = client.register_kv(pool, model="deadline")
        tokens = np.arange(16)
        frames = [wire.keys_frame(client.keys(tokens)), wire.pages_frame(np.arange(4))]
        try:
            client.channel.request("store", {"reg": reg.id, "deadline_us": 1}, frames)
        except DeadlineExceeded:
            pass
        else:
            raise AssertionError("a store past its deadline was kept")
        assert client.lookup(tokens) == 0
        assert client.store(tokens, np.arange(4)) == 16  # the client's own deadline is in the future
        assert client.lookup(tokens) == 16
        pool.close()
