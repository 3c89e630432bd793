"""vLLM's KV cache groups through kvd (no vLLM, no daemon): a namespace per group, hits limited.

With vLLM's hybrid manager a model mixing full-attention and sliding-window
layers has a KV cache group per kind (kvd_client.vllm.groups). Each group
gets a namespace of its own (its kind, window and layers in the
fingerprint); the one full-attention group of a plain model keeps the plain
namespace. The scheduler's lookups go to every group (a stand-in client
answers them here) and a hit is the shortest group's; a load fills the
sliding-window group's blocks from the first one vLLM allocates (the null
placeholders below are left alone), and a store skips the window's chunks
whose blocks vLLM already freed.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from test_support import NAMES, SlidingWindowSpec, configs, group

from kvd_client.vllm import spec as spec_mod
from kvd_client.vllm import support
from kvd_client.vllm.counters import Counters
from kvd_client.vllm.groups import NULL_BLOCK, KVGroup, kv_groups
from kvd_client.vllm.scheduler import SchedulerSide
from kvd_client.vllm.settings import Settings
from kvd_protocol.keys import Namespace, namespace_digest

BS, CHUNK = 16, 32   # two blocks per chunk


def hybrid(window=32, **settings):
    return configs(groups=[group(NAMES[1:], SlidingWindowSpec(sliding_window=window)),
                           group(NAMES[:1])], **settings)


def test_each_group_has_a_namespace_of_its_own_and_a_plain_model_keeps_its_own():
    vllm_config, kv = hybrid()
    assert support.refusal(vllm_config, kv, {}) is None
    groups = kv_groups(vllm_config, kv)
    assert [(g.gid, g.kind, g.window) for g in groups] == [(1, "FullAttentionSpec", 0),
                                                           (0, "SlidingWindowSpec", 32)]
    geos = [spec_mod.geometry(vllm_config, kv, group=g) for g in groups]
    assert [g.fingerprint for g in geos] == ["group=full:0", "group=swa32:1"]
    assert len({namespace(g) for g in geos}) == 2 and all(g.num_layers == 1 for g in geos)
    plain = spec_mod.geometry(*configs())
    assert plain.fingerprint == "" and plain.num_layers == 2
    other_window = spec_mod.geometry(*hybrid(window=64), group=kv_groups(*hybrid(window=64))[1])
    assert other_window.fingerprint == "group=swa64:1"
    fp8 = spec_mod.geometry(*hybrid(cache_dtype="fp8"), kv_scales="ab" * 8, group=groups[1])
    assert fp8.fingerprint == f"kv_scales={'ab' * 8} group=swa32:1"


def test_a_window_needs_the_blocks_vllm_keeps():
    g = KVGroup(0, ("l",), "SlidingWindowSpec", window=32)
    # vLLM's get_num_skipped_tokens(n) = max(0, n - window + 1): blocks below it are null
    assert [g.first_block(n, BS) for n in (0, 31, 32, 64, 96)] == [0, 0, 0, 2, 4]
    assert [g.held_chunk(n, BS, CHUNK) for n in (0, 64, 80, 96)] == [0, 1, 2, 2]
    assert KVGroup(0, ("l",), "FullAttentionSpec").first_block(1000, BS) == 0
    assert KVGroup(0, ("l",), "SlidingWindowSpec", 32, extra=16).first_block(96, BS) == 3


class Lookups:
    """A client stand-in: each namespace holds the first ``held[fingerprint]`` chunks."""

    limits: dict = {}  # a daemon that says nothing of partial chunks: whole-chunk hits

    def __init__(self, held):
        self.held, self.released = held, []

    def submit_lookup(self, keys, lease_ms, reg):
        found = min(self.held[reg.namespace.fingerprint], len(keys))
        return SimpleNamespace(poll=lambda: True, wait=lambda t: True, cancel=lambda: None,
                               answered_at=time.monotonic(),
                               result=lambda: (found * CHUNK, id(reg)))

    def release(self, lease, wait=True):
        self.released.append(lease)


def namespace(geo):
    return Namespace(model=geo.model, kv_dtype=geo.kv_dtype, attention=geo.attention,
                     num_layers=geo.num_layers, kv_heads=geo.kv_heads, head_dim=geo.head_dim,
                     chunk_tokens=CHUNK, tp_size=1, fingerprint=geo.fingerprint)


def scheduler(held):
    vllm_config, kv = hybrid()
    groups = kv_groups(vllm_config, kv)
    regs = [SimpleNamespace(namespace=namespace(spec_mod.geometry(vllm_config, kv, group=g)))
            for g in groups]
    settings = Settings(async_load_min_tokens=1 << 20, lookup_wait_ms=10.0)
    return SchedulerSide(Lookups(held), regs, settings, BS, loads=True, stores=True,
                         counters=Counters(), groups=groups)


def output(new=(), scheduled=None):
    return SimpleNamespace(scheduled_new_reqs=list(new), num_scheduled_tokens=scheduled or {},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                 num_computed_tokens=[],
                                                                 resumed_req_ids=set()))


def request(n, rid="r"):
    return SimpleNamespace(request_id=rid, all_token_ids=list(range(100, 100 + n)), num_tokens=n,
                           num_prompt_tokens=n, num_computed_tokens=0, cache_salt=None,
                           lora_request=None)


@pytest.mark.parametrize("full, window, hit", [(5, 5, 5), (5, 3, 3), (2, 5, 2), (5, 0, 0)])
def test_a_hit_is_the_longest_prefix_every_group_holds(full, window, hit):
    sched = scheduler({"group=full:0": full, "group=swa32:1": window})
    tokens, asynchronous = sched.matched(request(6 * CHUNK + 1), 0)
    assert tokens == hit * CHUNK
    assert asynchronous == bool(hit)   # several groups: vLLM takes failures per request only


def test_the_window_group_loads_only_the_blocks_vllm_allocated_for_it():
    sched = scheduler({"group=full:0": 6, "group=swa32:1": 6})
    req = request(5 * CHUNK + 1)
    assert sched.matched(req, 0) == (5 * CHUNK, True)
    full = list(range(1, 11))
    window = [NULL_BLOCK] * 8 + [21, 22]   # vLLM: blocks below the window are null
    sched.allocated(req, SimpleNamespace(get_block_ids=lambda: (window, full)), 5 * CHUNK)
    plan = sched.step(output())
    (a, b) = plan.loads
    assert (a.group, a.pages, len(a.keys), a.tokens) == (0, full, 5, 5 * CHUNK)
    assert (b.group, b.pages, len(b.keys), b.tokens, b.scratch) == (1, [21, 22], 1, 5 * CHUNK, 0)
    assert b.keys[0] != a.keys[4]     # the same chunk, another namespace


def test_the_window_group_stores_only_chunks_whose_blocks_are_still_held():
    sched = scheduler({"group=full:0": 0, "group=swa32:1": 0})
    req = request(4 * CHUNK)
    sched.matched(req, 0)
    full, window = list(range(1, 9)), list(range(11, 19))
    new = SimpleNamespace(req_id="r", block_ids=(window, full), num_computed_tokens=80)
    # 80 computed before this step: vLLM freed the window's blocks 0..2, so chunks 0 and 1 go
    plan = sched.step(output([new], {"r": 48}))
    by_group = {s.group: s for s in plan.stores}
    assert by_group[0].pages == full and len(by_group[0].keys) == 4
    assert by_group[1].pages == window[4:] and len(by_group[1].keys) == 2
    assert sched.finished(req, (window, full)) is True
    assert namespace_digest(sched.regs[0].namespace) != namespace_digest(sched.regs[1].namespace)
