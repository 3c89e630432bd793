"""Hits at vLLM's block size, not kvd's chunk size: both connector halves on a real daemon.

A prompt kvd holds whole is a hit of all but its last block (vLLM computes at
least one token), the last chunk loaded in part (``tail_pages``): its first
blocks hold the storer's bytes, the blocks past them keep what they held.
Asynchronously, layer-wise, and layer-wise with too little left to compute
(the hit then ends ``layerwise_min_compute`` tokens earlier, on a block). The
counters say what each request recomputed. vLLM's objects are stand-ins
(tests/vllm/halves.py); test_engine_blocks.py runs the same in vLLM.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from halves import BS, CHUNK, Blocks, Request, fill, step_output, store_prompt


def until_received(engine, req_id: str) -> list:
    plans = []
    for _ in range(500):
        plan, _, recving, errors = engine.run_step(step_output())
        plans.append(plan)
        assert errors == set()
        if recving:
            assert recving == {req_id}
            return plans
        time.sleep(0.01)
    raise AssertionError("the async load never ended")


@pytest.mark.parametrize("extra, hit, layerwise, min_async", [
    (0, 4 * CHUNK - BS, False, 32),   # 64 tokens: all but the last block, async
    (0, 4 * CHUNK - BS, True, 1000),  # the same inside the step
    (1, 4 * CHUNK, False, 1000),      # 65: 64 leaves 1 token, fewer than 2: async after all
    (3, 4 * CHUNK, True, 1000),       # 67: 64 leaves 3 to compute: the 4 chunks whole
])
def test_a_stored_prompt_hits_all_but_its_last_block(engines, extra, hit, layerwise, min_async):
    _, make = engines
    a = make()
    b = make(async_load_min_tokens=min_async)
    tokens = list(range(500, 500 + 4 * CHUNK + extra))
    store_prompt(a, "r1", tokens, list(range(1, 1 + len(tokens) // BS)))
    req = Request("r2", tokens)
    assert b.sched.matched(req, 0) == (hit, not layerwise)
    ids = list(range(30, 30 + -(-len(tokens) // BS)))
    b.sched.allocated(req, Blocks(ids), hit)
    fill(b, ids, seed=7)
    before = b.kv.copy()
    if layerwise:
        plan, _, _, errors = b.run_step(step_output(new=[("r2", ids, 0)],
                                                    scheduled={"r2": len(tokens) - hit}))
        assert errors == set()
    else:
        plan = until_received(b, "r2")[0]
    load = plan.loads[0]
    assert len(load.keys) == -(-hit // CHUNK) and load.tail == hit % CHUNK // BS
    assert load.pages == ids[:hit // BS] and load.layerwise == layerwise
    n = hit // BS  # blocks loaded: the storer's, the rest of the pool as it was
    assert np.array_equal(b.kv[:, ids[:n]], a.kv[:, list(range(1, 1 + n))])
    b.kv[:, ids[:n]] = before[:, ids[:n]]
    assert np.array_equal(b.kv, before), "a block past the hit was written"
    c = b.counters.take()
    assert c["hit_tokens"] == c["loaded_tokens"] == hit and "load_failures" not in c
    b.sched.finished(req, ids)
    c = b.counters.take()
    assert (c["requests"], c["prompt_tokens"], c["recomputed_tokens"]) == \
        (1, len(tokens), len(tokens) - hit)


@pytest.mark.parametrize("extra, hit", [(0, 2 * CHUNK - BS), (1, 2 * CHUNK - BS)])
def test_a_hit_past_a_local_hit_that_ends_inside_a_chunk(engines, extra, hit):
    """vLLM's own prefix cache holds the first 2 blocks (block-granular): kvd adds the rest
    up to the last block, its first chunk's local blocks going to scratch as before. A load
    starting inside a chunk runs in the step, so with 33 tokens (32 would leave 1 to
    compute, fewer than 2) the hit ends a block earlier instead."""
    _, make = engines
    a, b = make(), make(async_load_min_tokens=1000)
    tokens = list(range(900, 900 + 2 * CHUNK + extra))
    store_prompt(a, "r1", tokens, list(range(1, 9)))
    req = Request("r2", tokens)
    assert b.sched.matched(req, 2 * BS) == (hit - 2 * BS, False)
    ids = list(range(40, 49))
    b.sched.allocated(req, Blocks(ids), hit - 2 * BS)
    plan, _, _, errors = b.run_step(step_output(new=[("r2", ids, 2 * BS)],
                                                scheduled={"r2": len(tokens) - hit}))
    load = plan.loads[0]
    assert errors == set() and load.scratch == 2 and load.tail == 3
    # the local hit's 2 blocks go to one scratch block, not to the request's blocks of the hit
    assert load.pages[2:] == ids[2:7] and len(set(load.pages[:2])) == 1
    assert load.pages[0] not in ids[:7]
    assert np.array_equal(b.kv[:, ids[2:7]], a.kv[:, list(range(3, 8))])


def finish_with_tail(e, req_id: str, tokens: list, blocks: list) -> None:
    """A request that computed ``tokens`` (not a whole number of chunks) and ended: its whole
    chunks and its tail, cut to a block, go to kvd (the tail as a partial entry)."""
    req = Request(req_id, tokens)
    assert e.sched.matched(req, 0)[0] == 0
    e.sched.allocated(req, Blocks(blocks), 0)
    fill(e, blocks, seed=len(tokens))
    e.run_step(step_output(new=[(req_id, blocks, 0)], scheduled={req_id: len(tokens)}))
    req.num_computed_tokens = len(tokens)
    assert e.sched.finished(req, blocks) is True
    for _ in range(500):
        plan, sending, _, _ = e.run_step(step_output(), finished=[req_id])
        if sending:
            return
        time.sleep(0.01)
    raise AssertionError("the stores were never reported done")


@pytest.mark.parametrize("layerwise", [True, False])
def test_the_next_turn_hits_the_previous_turns_tail(engines, layerwise):
    """Turn 1 (2 chunks and 7 tokens) ends: its 2 chunks and a partial entry of its first
    4 tail tokens are stored. Turn 2 holds turn 1 and more: its hit is the 2 chunks and the
    partial entry (36 tokens, not 32), loaded exactly, the blocks past it untouched."""
    daemon, make = engines
    a = make()
    b = make(async_load_min_tokens=1000 if layerwise else 32)
    turn1 = list(range(700, 700 + 2 * CHUNK + 7))
    finish_with_tail(a, "t1", turn1, list(range(1, 11)))
    assert daemon.stats()["tiers"]["host"]["entries"] == 3
    turn2 = turn1 + list(range(60, 80))                  # 59 tokens: chunk 2 is whole now
    req = Request("t2", turn2)
    hit = 2 * CHUNK + BS
    assert b.sched.matched(req, 0) == (hit, not layerwise)
    ids = list(range(30, 30 + -(-len(turn2) // BS)))
    b.sched.allocated(req, Blocks(ids), hit)
    fill(b, ids, seed=8)
    before = b.kv.copy()
    if layerwise:
        plan, _, _, errors = b.run_step(step_output(new=[("t2", ids, 0)],
                                                    scheduled={"t2": len(turn2) - hit}))
        assert errors == set()
    else:
        plan = until_received(b, "t2")[0]
    whole, part = plan.loads
    assert (len(whole.keys), whole.pages, whole.part) == (2, ids[:8], 0)
    assert (len(part.keys), part.pages, part.part) == (1, ids[8:9], BS)
    n = hit // BS
    assert np.array_equal(b.kv[:, ids[:n]], a.kv[:, list(range(1, 1 + n))])
    b.kv[:, ids[:n]] = before[:, ids[:n]]
    assert np.array_equal(b.kv, before), "a block past the hit was written"
    c = b.counters.take()
    assert c["hit_tokens"] == c["loaded_tokens"] == hit and "load_failures" not in c
    b.sched.finished(req, ids)
    assert b.counters.take()["recomputed_tokens"] == len(turn2) - hit


def test_a_tail_is_not_read_as_another_length_or_another_prefix(engines):
    """A partial entry answers only its own tokens: a next turn whose tail differs in its
    first tokens gets the whole chunks alone."""
    _, make = engines
    a, b = make(), make()
    turn1 = list(range(100, 100 + 2 * CHUNK + 7))
    finish_with_tail(a, "u1", turn1, list(range(1, 11)))
    other = turn1[:2 * CHUNK] + [5] + turn1[2 * CHUNK + 1:] + list(range(60, 80))
    assert b.sched.matched(Request("u2", other), 0)[0] == 2 * CHUNK
