"""vLLM 0.34 lends the KV memory out (sleep, weight updates) and gives it back.

The worker half against a real daemon (tests/vllm/halves.py): ``release``
(what ``unregister_kv_caches`` calls) waits for the transfers in flight and
drops the worker's registration while the daemon keeps every chunk; the
same pool registered again (``restore_kv_caches``) loads them byte-exact. And
``support`` no longer refuses sleep mode, the cumem allocator or expandable
segments when vLLM 0.34's extensible KV cache is on (the memory is shared by
file descriptor, outside PyTorch's allocator), but still does without it.
"""

from __future__ import annotations

import time

import numpy as np
from halves import Blocks, Request, step_output, store_prompt
from test_support import configs

from kvd_client.vllm import support


def test_release_keeps_the_daemons_chunks_and_register_brings_the_pool_back(engines):
    daemon, make = engines
    a = make()
    tokens = list(range(700, 750))  # 3 whole chunks
    store_prompt(a, "r1", tokens, list(range(1, 14)))
    want = a.kv[:, list(range(1, 13))].copy()
    pool = a.worker.reg.pool
    before = daemon.stats()["registrations"]
    a.worker.release(2.0)
    assert a.worker.regs == [] and daemon.stats()["registrations"] == before - 1
    assert daemon.stats()["tiers"]["host"]["chunks"] == 3  # nothing of the cache went
    a.kv[:] = 0x5A  # the memory was lent out: its contents are gone
    a.worker.register(pool)
    assert daemon.stats()["registrations"] == before
    req = Request("r2", tokens)
    assert a.sched.matched(req, 0) == (48, True)
    ids = list(range(20, 33))
    a.sched.allocated(req, Blocks(ids), 48)
    deadline = time.monotonic() + 10
    while True:
        _, _, recving, errors = a.run_step(step_output())
        assert errors == set()
        if "r2" in (recving or ()):
            break
        assert time.monotonic() < deadline, "the load never finished"
        time.sleep(0.01)
    assert np.array_equal(a.kv[:, ids[:12]], want)


def test_memory_settings_are_served_with_the_extensible_cache_only():
    for setting in (dict(enable_sleep_mode=True), dict(enable_cumem_allocator=True)):
        vllm_config, kv_cache_config = configs(**setting)
        assert support.refusal(vllm_config, kv_cache_config, {})
        vllm_config.cache_config.enable_extensible_kv_cache = True
        assert support.refusal(vllm_config, kv_cache_config, {}) is None
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    vllm_config, kv_cache_config = configs()
    assert "expandable_segments" in support.refusal(vllm_config, kv_cache_config, env)
    vllm_config.cache_config.enable_extensible_kv_cache = True
    assert support.refusal(vllm_config, kv_cache_config, env) is None
