"""kvd.cuda.dma.plan's pitched ops against a plain loop over (layer, chunk, plane, page), no GPU.

Every byte the ops of layers ``[a, b)`` copy must be exactly the bytes of the
page-by-page reference for those layers (same pool address for the same host
address, the direction's side as source), no op may reach across two
registered host pieces or have rows that overlap, and the ops must be few:
one per run of pages when the planes sit at one pitch (one allocation, as
vLLM's), one per run and plane when each plane's layers do (SGLang's), and
runs merge where page ids run on.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.cuda.dma import path as dma
from kvd.cuda.dma import plan as dma_plan
from kvd_protocol.layout import LayoutDescriptor

HOST0 = 1 << 32


def layout(layers=3, planes=2, pages=40, page_size=4, row=256):
    bases = tuple((0, (i * pages + 1) * page_size * row) for i in range(layers * planes))
    return LayoutDescriptor(layers, planes, pages, page_size, row, page_size * row, row, bases)


def plane_bases(d, kind):
    plane = d.num_pages * d.page_stride
    lp = np.arange(d.num_layers * d.planes)
    if kind == "one allocation":
        offsets = lp * plane
    elif kind == "per plane":   # all K planes, then all V planes, each at its own pitch
        k, layer = lp % d.planes, lp // d.planes
        offsets = k * (d.num_layers * plane + 4096) + layer * plane
    else:                       # each plane below the one before: no pitch
        offsets = (lp.size - lp) * (plane + 512)
    return (np.uint64(1 << 30) + offsets.astype(np.uint64)).astype(np.uint64)


def reference(d, bases, ids, shard_ptrs, chunk_tokens, a, b):
    ppc = chunk_tokens // d.page_size
    out = set()
    for layer in range(a, b):
        for c, shard in enumerate(shard_ptrs):
            for k in range(d.planes):
                for j in range(ppc):
                    pool = int(bases[layer * d.planes + k]) + int(ids[c * ppc + j]) * d.page_stride
                    lp = layer * d.planes + k
                    host = int(shard) + (lp * chunk_tokens + j * d.page_size) * d.row_bytes
                    out.update((host + off, pool + off) for off in range(0, d.page_size * d.row_bytes, 64))
    return out


def step_rows(step):
    """``(src, dst, width)`` of every row of a step: its pitched ops' rows, its single rows."""
    for op in step.ops:
        w = int(op["width"])
        for i in range(int(op["height"])):
            yield int(op["src"]) + i * (int(op["src_pitch"]) or w), \
                int(op["dst"]) + i * (int(op["dst_pitch"]) or w), w
    yield from zip(step.src.tolist(), step.dst.tolist(), step.size.tolist())


def covered(step, to_host, step_bytes=64):
    out = set()
    for src, dst, w in step_rows(step):
        host, pool = (dst, src) if to_host else (src, dst)
        out.update((host + off, pool + off) for off in range(0, w, step_bytes))
    return out


@pytest.mark.parametrize("min_rows", [2, dma_plan.MIN_ROWS])
@pytest.mark.parametrize("kind", ["one allocation", "per plane", "descending"])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("registration", [1 << 40, 3072])
def test_steps_cover_the_reference_exactly(kind, consecutive, registration, min_rows, monkeypatch):
    monkeypatch.setattr(dma_plan, "MIN_ROWS", min_rows)
    d, chunk_tokens, n = layout(layers=9), 16, 3
    ppc = chunk_tokens // d.page_size
    rng = np.random.default_rng(int(consecutive) + registration % 7)
    ids = np.arange(n * ppc) + 5 if consecutive else rng.permutation(d.num_pages)[:n * ppc]
    bases = plane_bases(d, kind)
    shard = d.shard_bytes(chunk_tokens)
    shard_ptrs = np.array([HOST0, HOST0 + shard, HOST0 + 3 * shard + 64], np.uint64)
    args = (d, bases, ids, shard_ptrs, chunk_tokens, (HOST0, registration))
    everything = reference(d, bases, ids, shard_ptrs, chunk_tokens, 0, d.num_layers)
    for to_host in (True, False):
        for by_layer in (False, True):
            c = dma_plan.CopyOps(*args, to_host=to_host, by_layer=by_layer)
            assert c.layer_bytes * d.num_layers == n * shard
            if registration > 1 << 30 and (by_layer or kind == "descending"):
                assert c.rows_per_run  # single rows, planned without the general pass
            steps = c.steps(d.num_layers * d.planes * 2048)  # 2 page runs of 1 KiB per step
            assert sum(s.nbytes for s in steps) == n * shard  # nothing twice
            seen = set()
            for k, step in enumerate(steps):
                got = covered(step, to_host)
                if by_layer:
                    assert got == reference(d, bases, ids, shard_ptrs, chunk_tokens, k, k + 1)
                    assert not step.ops.size
                else:
                    runs = c.run_steps(d.num_layers * d.planes * 2048)[k]
                    assert got == {(h, p) for h, p in everything if _in_run(c, runs, h, d)}
                seen |= got
                for src, dst, w in step_rows(step):
                    host = dst if to_host else src
                    assert (host - HOST0) // registration == (host + w - 1 - HOST0) // registration
                for op in step.ops:
                    assert op["src_pitch"] >= op["width"] and op["dst_pitch"] >= op["width"]
            assert seen == everything
    if registration > 1 << 30:
        runs = n if consecutive else n * ppc
        lp = d.planes * d.num_layers
        groups = {"one allocation": 1 if lp >= min_rows else lp,
                  "per plane": d.planes if d.num_layers >= min_rows else lp,
                  "descending": lp}[kind]
        whole = dma_plan.CopyOps(*args, to_host=True).steps(1 << 62)
        assert len(whole) == 1 and len(whole[0].ops) + len(whole[0].size) == runs * groups
        assert len(c.run_steps(1)) == runs


@pytest.mark.parametrize("pages_per_chunk", [1, 2])
def test_block_outer_pages_of_one_chunk_go_as_single_rows(pages_per_chunk):
    """A block-outer pool (a page's planes adjacent) with chunks of one page: each page is
    one range on both sides, so one single row per page and no pitched op; with two pages
    a chunk, the arena's planes are two pages apart and the ops stay pitched."""
    page, row, lp = 4, 256, 9 * 2  # at least MIN_ROWS planes: pitched, else one by one
    d = LayoutDescriptor(9, 2, 40, page, row, lp * page * row, row,
                         tuple((0, i * page * row) for i in range(lp)))
    bases = np.uint64(1 << 30) + np.arange(lp, dtype=np.uint64) * np.uint64(page * row)
    chunk_tokens, n = page * pages_per_chunk, 5
    ids = np.random.default_rng(3).permutation(d.num_pages)[:n * pages_per_chunk]
    shard_ptrs = HOST0 + np.arange(n, dtype=np.uint64) * np.uint64(d.shard_bytes(chunk_tokens))
    want = reference(d, bases, ids, shard_ptrs, chunk_tokens, 0, d.num_layers)
    for to_host in (True, False):
        c = dma_plan.CopyOps(d, bases, ids, shard_ptrs, chunk_tokens, (HOST0, 1 << 40), to_host)
        (step,) = c.steps(1 << 62)
        assert covered(step, to_host) == want
        if pages_per_chunk == 1:
            assert not step.ops.size and step.size.tolist() == [lp * page * row] * n
        else:
            assert not step.size.size and len(step.ops) == n * pages_per_chunk
        by_layer = dma_plan.CopyOps(d, bases, ids, shard_ptrs, chunk_tokens, (HOST0, 1 << 40),
                                    to_host, by_layer=True)
        for k, layer_step in enumerate(by_layer.steps(1 << 62)):
            assert covered(layer_step, to_host) == reference(d, bases, ids, shard_ptrs,
                                                             chunk_tokens, k, k + 1)


@pytest.mark.parametrize("registration", [1 << 40, 3 * 9 * 2 * 4 * 256 + 512])
@pytest.mark.parametrize("to_host", [True, False])
def test_block_outer_fast_plan_is_the_general_plan(registration, to_host, monkeypatch):
    """The planning shortcut for a block-outer chunk of one page gives the same steps, runs
    and rows as the general pass, in steps of a few runs, and where chunks cross a
    registration (the shortcut steps aside) covers the reference exactly."""
    page, row, lp = 4, 256, 9 * 2
    d = LayoutDescriptor(9, 2, 40, page, row, lp * page * row, row,
                         tuple((0, i * page * row) for i in range(lp)))
    bases = np.uint64(1 << 30) + np.arange(lp, dtype=np.uint64) * np.uint64(page * row)
    ids = np.random.default_rng(5).permutation(d.num_pages)[:7]
    shard_ptrs = HOST0 + np.arange(7, dtype=np.uint64) * np.uint64(d.shard_bytes(page) + 256)
    args = (d, bases, ids, shard_ptrs, page, (HOST0, registration), to_host)
    most = 2 * lp * page * row  # two runs a step
    fast = dma_plan.CopyOps(*args)
    monkeypatch.setattr(dma_plan.CopyOps, "_chunk_per_row", lambda *a: False)
    general = dma_plan.CopyOps(*args)
    assert (fast.rows_per_run == 1) == (registration > 1 << 30)
    for name in ("run_chunk", "run_width", "run_host", "op_run"):
        assert getattr(fast, name).tolist() == getattr(general, name).tolist(), name
    assert fast.layer_bytes == general.layer_bytes
    steps = fast.steps(most)
    assert len(steps) == 4
    for a, b in zip(steps, general.steps(most)):
        assert a.ops.tobytes() == b.ops.tobytes()
        for x, y in ((a.dst, b.dst), (a.src, b.src), (a.size, b.size)):
            assert x.tolist() == y.tolist()
    want = reference(d, bases, ids, shard_ptrs, page, 0, d.num_layers)
    assert set().union(*(covered(s, to_host) for s in steps)) == want


@pytest.mark.parametrize("kind", ["one allocation", "per plane", "descending", "block-outer"])
@pytest.mark.parametrize("n", [1, 3])
def test_step_arrays_are_what_the_driver_reads(kind, n):
    """The driver reads each step's ``dst``, ``src`` and ``size`` (and its ops) as packed
    arrays from their first address: every one C-contiguous, of its dtype, with one chunk
    (where a broadcast view has 0 strides) as with several."""
    d, chunk_tokens = layout(layers=9), 4
    if kind == "block-outer":
        lp, page_bytes = 18, d.page_size * d.row_bytes
        d = LayoutDescriptor(9, 2, 40, d.page_size, d.row_bytes, lp * page_bytes, d.row_bytes,
                             tuple((0, i * page_bytes) for i in range(lp)))
        bases = np.uint64(1 << 30) + np.arange(lp, dtype=np.uint64) * np.uint64(page_bytes)
    else:
        bases = plane_bases(d, kind)
    ids = np.random.default_rng(n).permutation(d.num_pages)[:n]
    shard_ptrs = HOST0 + np.arange(n, dtype=np.uint64) * np.uint64(d.shard_bytes(chunk_tokens))
    for to_host in (True, False):
        for by_layer in (False, True):
            c = dma_plan.CopyOps(d, bases, ids, shard_ptrs, chunk_tokens, (HOST0, 1 << 40),
                                 to_host, by_layer=by_layer)
            for step in c.steps(1 << 62) + c.steps(1):
                for a in (step.dst, step.src, step.size):
                    assert a.dtype == np.uint64 and a.flags.c_contiguous
                    assert a.size == step.size.size
                assert step.ops.dtype == dma_plan.OP_DTYPE
                assert np.ascontiguousarray(step.ops).tobytes() == step.ops.tobytes()
                assert (step.size > 0).all()


def _in_run(c, runs, host, d):
    """Whether arena address ``host`` is in one of ``runs`` (any plane of its chunk)."""
    planes = d.num_layers * d.planes
    return any(start <= host < start + planes * c.plane_bytes and (host - start) % c.plane_bytes < width
               for start, width in zip(c.run_host[runs].tolist(), c.run_width[runs].tolist()))


def test_row_groups_pick_the_fewer():
    d = layout(layers=4, planes=2)
    assert dma_plan.row_groups(plane_bases(d, "one allocation"), 4, 2) == [
        (0, 1, 8, d.num_pages * d.page_stride)]
    groups = dma_plan.row_groups(plane_bases(d, "per plane"), 4, 2)
    assert [(f, s, n) for f, s, n, _ in groups] == [(0, 2, 4), (1, 2, 4)]
    assert [n for _, _, n, _ in dma_plan.row_groups(plane_bases(d, "descending"), 4, 2)] == [1] * 8
    far = np.array([0, dma_plan.MAX_PITCH + 1], np.uint64)  # too far apart for one op
    assert dma_plan.row_groups(far, 2, 1) == [(0, 1, 1, 0), (1, 1, 1, 0)]


def test_eligible_only_for_pages_that_are_one_range():
    d = layout(page_size=16, row=2048)
    assert dma.eligible(d, 32 << 10) and not dma.eligible(d, 64 << 10)
    strided = LayoutDescriptor(1, 1, 8, 16, 2048, 16 * 4096, 4096, ((0, 0),))
    assert not dma.eligible(strided, 1)


def test_eligible_counts_the_rows_a_pitched_op_moves():
    """32 KiB pages under a 64 KiB threshold: by DMA when every op has >= MIN_ROWS (16) planes
    at one pitch (18 planes in one allocation), not when the groups are smaller (9 per plane)
    or the planes are in separate allocations, nor for rows under 16 KiB."""
    d = layout(layers=9, page_size=16, row=2048)
    assert dma.eligible(d, 64 << 10, groups(d, "one allocation"))
    assert not dma.eligible(d, 64 << 10, groups(d, "per plane"))
    assert not dma.eligible(d, 64 << 10, groups(d, "descending"))
    apart = LayoutDescriptor(9, 2, 40, 16, 2048, 16 * 2048, 2048,
                             tuple((i, 0) for i in range(18)))  # each plane its own buffer
    assert not dma.eligible(apart, 64 << 10, dma_plan.pool_groups(apart, plane_bases(d, "one allocation")))
    small = layout(layers=9, page_size=4, row=2048)  # 8 KiB rows
    assert not dma.eligible(small, 64 << 10, groups(small, "one allocation"))


def groups(d, kind):
    return dma_plan.pool_groups(d, plane_bases(d, kind))
