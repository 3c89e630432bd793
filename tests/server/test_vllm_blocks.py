"""vLLM's GPU blocks (head-strided token rows) through a real daemon's host backend.

Pools in /dev/shm (tests/vllm_blocks.py) in vLLM's block layout, heads
outer (HNC) or tokens outer (NHC), registered as the vLLM connector's
worker registers them (attention ``mha``, the plain model id), and a plain
``vllm_flash_attn`` pool of the same model, all filled with random bytes:
what one stores, another loads into poisoned pages, every token row equal
to the storer's by the engines' own tensor indexing (never kvd's layout
code), and no byte outside the loaded pages changes.
"""

from __future__ import annotations

import numpy as np
import pytest
from vllm_blocks import VllmBlocksPool, over, put_rows, token_rows

from kvd_client import KvdClient, SharedKVPool
from kvd_protocol import wire

CHUNK = 16                  # the test daemons' chunk_tokens
LAYERS, HEADS, DIM = 3, 4, 8
TOKENS = 5 * CHUNK


def blocks(block_size: int) -> int:
    return 2 * TOKENS // block_size + 3  # room for other pages than the ones a test uses


def make(kind: str, block_size: int, seed: int):
    n = blocks(block_size)
    if kind == "flash":
        pool = SharedKVPool("vllm_flash_attn", LAYERS, n, block_size, HEADS, DIM, "bfloat16")
    else:
        pool = VllmBlocksPool(kind, LAYERS, n, block_size, HEADS, DIM)
    pool.raw[:] = np.random.default_rng(seed).integers(0, 256, pool.raw.size, dtype=np.uint8)
    return pool


@pytest.fixture
def pools():
    made = []

    def new(kind: str, block_size: int, seed: int):
        made.append(make(kind, block_size, seed))
        return made[-1]

    yield new
    for p in made:
        p.close()


@pytest.mark.parametrize("src, dst", [("HNC", "NHC"), ("NHC", "HNC"), ("HNC", "flash"),
                                      ("NHC", "flash"), ("flash", "NHC"), ("HNC", "HNC")])
@pytest.mark.parametrize("src_bs, dst_bs", [(16, 16), (4, 16), (16, 1)])
def test_a_store_is_another_layouts_hit_byte_for_byte(daemon, pools, src, dst, src_bs, dst_bs):
    a, b = pools(src, src_bs, 1), pools(dst, dst_bs, 2)
    n = TOKENS
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 2**31, n)
    src_pages = rng.permutation(blocks(src_bs))[:n // src_bs]
    dst_pages = rng.permutation(blocks(dst_bs))[:n // dst_bs]
    want = token_rows(a, src_pages)
    with KvdClient(str(daemon.runtime_dir), raise_errors=True) as client:
        ra = client.register_kv(a, model="tiny")
        rb = client.register_kv(b, model="tiny")
        assert ra.namespace == rb.namespace
        assert client.store(tokens, src_pages, reg=ra) == n
        before = b.raw.copy()
        assert client.lookup(tokens, reg=rb) == n
        assert client.load(tokens, dst_pages, reg=rb) == n
    assert np.array_equal(token_rows(b, dst_pages), want)
    expect = before.copy()
    put_rows(b, over(b, expect), dst_pages, want)
    bad = np.flatnonzero(b.raw != expect)
    assert bad.size == 0, f"{bad.size} bytes outside the loaded rows changed, first at {bad[:4]}"
    assert daemon.stats()["errors"] == 0


def test_the_worker_registers_head_strided_rows(pools):
    """What goes on the wire for vLLM's GPU blocks: heads and head_stride, attention mha."""
    for order in ("HNC", "NHC"):
        p = pools(order, 16, 4)
        m = wire.layout_to_wire(p.descriptor)
        assert (m["heads"], m["head_stride"]) == (HEADS, p.tensors[0].strides[1])
        assert m["row_bytes"] == HEADS * DIM * 2 and p.attention == "mha"
