"""kvd.cuda.dma_plan's pitched ops against a plain loop over (layer, chunk, plane, page), no GPU.

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

from kvd.cuda import dma, dma_plan
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


def rows(ops):
    """``(src, dst, width)`` of every row of every op."""
    for op in ops:
        w = int(op["width"])
        for i in range(int(op["height"])):
            yield int(op["src"]) + i * (int(op["src_pitch"]) or w), \
                int(op["dst"]) + i * (int(op["dst_pitch"]) or w), w


def covered(ops, to_host, step=64):
    out = set()
    for src, dst, w in rows(ops):
        host, pool = (dst, src) if to_host else (src, dst)
        out.update((host + off, pool + off) for off in range(0, w, step))
    return out


@pytest.mark.parametrize("min_rows", [2, dma_plan.MIN_ROWS])
@pytest.mark.parametrize("kind", ["one allocation", "per plane", "descending"])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("registration", [1 << 40, 3072])
def test_ops_cover_the_reference_exactly(kind, consecutive, registration, min_rows, monkeypatch):
    monkeypatch.setattr(dma_plan, "MIN_ROWS", min_rows)
    d, chunk_tokens, n = layout(layers=9), 16, 3
    ppc = chunk_tokens // d.page_size
    rng = np.random.default_rng(int(consecutive) + registration % 7)
    ids = np.arange(n * ppc) + 5 if consecutive else rng.permutation(d.num_pages)[:n * ppc]
    bases = plane_bases(d, kind)
    shard = d.shard_bytes(chunk_tokens)
    shard_ptrs = np.array([HOST0, HOST0 + shard, HOST0 + 3 * shard + 64], np.uint64)
    c = dma_plan.CopyOps(d, bases, ids, shard_ptrs, chunk_tokens, (HOST0, registration))
    assert c.layer_bytes * d.num_layers == n * shard
    every = slice(None)
    for a, b, runs in [(0, d.num_layers, every), (0, 1, every), (1, 3, every), (8, 9, every),
                       *[(0, d.num_layers, r) for r in c.run_steps(d.num_layers * d.planes * 2048)]]:
        for to_host in (True, False):
            ops = c.ops(a, b, to_host, runs)
            want = reference(d, bases, ids, shard_ptrs, chunk_tokens, a, b)
            if runs != every:
                want = {(h, p) for h, p in want if _in_run(c, runs, h, d)}
            assert covered(ops, to_host) == want
            if runs == every:
                assert int((ops["width"] * ops["height"]).sum()) == (b - a) * c.layer_bytes
            for src, dst, w in rows(ops):
                host = dst if to_host else src
                assert (host - HOST0) // registration == (host + w - 1 - HOST0) // registration
            for op in ops[ops["height"] > 1]:
                assert op["src_pitch"] >= op["width"] and op["dst_pitch"] >= op["width"]
                host = op["dst"] if to_host else op["src"]
                pitch = op["dst_pitch"] if to_host else op["src_pitch"]
                end = host + (op["height"] - 1) * pitch + op["width"]
                assert (host - HOST0) // registration == (end - 1 - HOST0) // registration
    if registration > 1 << 30:
        runs = n if consecutive else n * ppc
        lp = d.planes * d.num_layers
        groups = {"one allocation": 1 if lp >= min_rows else lp,
                  "per plane": d.planes if d.num_layers >= min_rows else lp,
                  "descending": lp}[kind]
        assert len(c.ops(0, d.num_layers, True)) == runs * groups
        covered_runs = [r for step in c.run_steps(1) for r in range(step.start, step.stop)]
        assert covered_runs == list(range(runs)) and len(c.run_steps(1)) == runs


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
