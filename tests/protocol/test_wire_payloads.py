"""The payloads of kvd_protocol.wire: bulk frames, the strict maps of ``register``, ``part_tokens``.

Keys and page-id frames round-trip and refuse bad lengths; the namespace,
layout, buffers and flags maps of a ``register`` round-trip (through
msgpack too) and refuse anything not exactly as specified; ``part_tokens``
is checked against the registration (no daemon). Framing and headers:
test_wire.py.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from wire_samples import CUDA_BUF, FLAGS, LAYOUT_WIRE, NS_WIRE, SAMPLES, SHM_BUF

from kvd_protocol import layout as L
from kvd_protocol import wire as P
from kvd_protocol.errors import BadRequest, TooLarge
from kvd_protocol.flags import FlagLayout
from kvd_protocol.keys import Namespace


# ---- bulk arrays ----------------------------------------------------------------

def test_keys_frame_round_trip():
    keys = [bytes([i]) * 16 for i in range(5)]
    frame = P.keys_frame(keys)
    assert frame == b"".join(keys) and len(frame) == 80
    assert P.keys_from_frame(frame, 5) == keys
    assert P.keys_from_frame(b"", 5) == []


@pytest.mark.parametrize("n", [1, 15, 17, 33])
def test_keys_frame_not_multiple_of_16(n):
    with pytest.raises(BadRequest, match="multiple of 16"):
        P.keys_from_frame(b"\0" * n, 100)


def test_too_many_keys():
    assert len(P.keys_from_frame(b"\0" * 16 * 4, 4)) == 4
    with pytest.raises(TooLarge):
        P.keys_from_frame(b"\0" * 16 * 5, 4)


def test_pages_frame_round_trip_little_endian():
    ids = [0, 1, 255, 256, 2**40, 2**63 - 1, -1]
    frame = P.pages_frame(ids)
    assert frame == b"".join(struct.pack("<q", i) for i in ids)
    back = P.pages_from_frame(frame)
    assert back.dtype == np.dtype("<i8") and back.tolist() == ids
    assert P.pages_frame(np.array([3, 4], dtype=np.int32)) == struct.pack("<2q", 3, 4)
    assert P.pages_from_frame(b"").tolist() == []


@pytest.mark.parametrize("n", [1, 7, 9, 15])
def test_pages_frame_not_multiple_of_8(n):
    with pytest.raises(BadRequest, match="multiple of 8"):
        P.pages_from_frame(b"\0" * n)


# ---- strict maps of register ----------------------------------------------------

def test_namespace_map_round_trip():
    ns = P.namespace_from_wire(dict(NS_WIRE), chunk_tokens=16)
    assert ns == Namespace(chunk_tokens=16, **NS_WIRE)
    assert P.namespace_to_wire(ns) == NS_WIRE


@pytest.mark.parametrize("mutate", [
    lambda m: m.pop("model"), lambda m: m.pop("tp_size"),
    lambda m: m.update(chunk_tokens=16), lambda m: m.update(extra=1),
    lambda m: m.update(num_layers="2"), lambda m: m.update(num_layers=True),
    lambda m: m.update(head_dim=-4), lambda m: m.update(model=5),
    lambda m: m.update(kv_dtype="fp16"), lambda m: m.update(attention="mla"),
    lambda m: m.update(num_layers=0), lambda m: m.update(model=""),
    lambda m: m.update(tp_size=2**31), lambda m: m.update(tp_size=65),
    lambda m: m.pop("first_layer"), lambda m: m.pop("fingerprint"),
    lambda m: m.update(first_layer=-1), lambda m: m.update(first_layer=1023),
    lambda m: m.update(fingerprint=5), lambda m: m.update(fingerprint="f" * 513),
], ids=["no-model", "no-tp", "chunk_tokens", "extra", "str-int", "bool-int", "negative",
        "int-str", "bad-dtype", "mla-with-2-heads", "zero-layers", "empty-model", "tp-too-big",
        "tp-over-cap", "no-first-layer", "no-fingerprint", "negative-first-layer",
        "layers-past-cap", "int-fingerprint", "long-fingerprint"])
def test_namespace_map_is_strict(mutate):
    m = dict(NS_WIRE)
    mutate(m)
    with pytest.raises(BadRequest, match="namespace"):
        P.namespace_from_wire(m, 16)


def test_namespace_map_not_a_map():
    with pytest.raises(BadRequest):
        P.namespace_from_wire([1, 2], 16)


def test_layout_map_round_trip():
    d = P.layout_from_wire(dict(LAYOUT_WIRE))
    assert isinstance(d, L.LayoutDescriptor)
    assert d.bases == ((0, 0), (0, 256), (0, 512), (0, 768))
    assert P.layout_to_wire(d) == LAYOUT_WIRE
    # through msgpack and back (tuples become lists)
    again = msgpack.unpackb(P.pack(P.layout_to_wire(d)))
    assert P.layout_from_wire(again) == d


def test_head_strided_layouts_carry_heads_and_head_stride():
    """Sent only when heads > 1 (a daemon that predates them still takes the rest); an
    old client's map, without them, means heads = 1."""
    plain = P.layout_from_wire(dict(LAYOUT_WIRE))
    assert (plain.heads, plain.head_stride) == (1, 0)
    assert "heads" not in P.layout_to_wire(plain)
    wire = {**LAYOUT_WIRE, "heads": 2, "head_stride": 32}
    d = P.layout_from_wire(dict(wire))
    assert (d.heads, d.head_stride, d.piece_bytes) == (2, 32, 8)
    assert P.layout_to_wire(d) == wire
    assert P.layout_from_wire(msgpack.unpackb(P.pack(P.layout_to_wire(d)))) == d
    assert P.layout_from_wire({**LAYOUT_WIRE, "heads": 1, "head_stride": 0}) == plain


@pytest.mark.parametrize("extra", [
    {"heads": 0}, {"heads": 257, "row_bytes": 257 * 16}, {"heads": 3}, {"heads": True},
    {"heads": "2"}, {"heads": -1}, {"heads": 2, "head_stride": -1},
    {"heads": 2, "head_stride": 2**48 + 1}, {"heads": 2, "head_stride": 1.5},
], ids=["zero", "over-cap", "indivisible", "bool", "str", "negative", "neg-stride",
        "stride-over-cap", "float-stride"])
def test_bad_heads_are_bad_requests(extra):
    with pytest.raises(BadRequest, match="layout"):
        P.layout_from_wire({**LAYOUT_WIRE, **extra})


@pytest.mark.parametrize("mutate", [
    lambda m: m.pop("bases"), lambda m: m.pop("row_bytes"), lambda m: m.update(extra=1),
    lambda m: m.update(planes=3), lambda m: m.update(num_pages=0), lambda m: m.update(num_layers=0),
    lambda m: m.update(page_stride=-1), lambda m: m.update(page_size=True),
    lambda m: m.update(bases="x"), lambda m: m.update(bases=[[0, 0]] * 3),
    lambda m: m.update(bases=[[0]] * 4), lambda m: m.update(bases=[[0, 0, 0]] * 4),
    lambda m: m.update(bases=[[-1, 0]] * 4), lambda m: m.update(bases=[[0, "0"]] * 4),
    lambda m: m.update(bases=[[True, 0]] * 4), lambda m: m.update(bases=[{"0": 0}] * 4),
    lambda m: m.update(num_layers=1025, bases=[[0, 0]] * 2050),
], ids=["no-bases", "no-row", "extra", "planes-3", "no-pages", "no-layers", "neg-stride",
        "bool", "bases-str", "bases-count", "short-pair", "long-pair", "neg-buffer",
        "str-offset", "bool-buffer", "map-pair", "too-many-layers"])
def test_layout_map_is_strict(mutate):
    m = {**LAYOUT_WIRE, "bases": [list(b) for b in LAYOUT_WIRE["bases"]]}
    mutate(m)
    with pytest.raises(BadRequest, match="layout"):
        P.layout_from_wire(m)


def test_buffers_maps():
    assert P.buffers_from_wire([SHM_BUF, CUDA_BUF], 2) == [SHM_BUF, CUDA_BUF]


@pytest.mark.parametrize("items,maxn", [
    ([], 4), ([SHM_BUF] * 3, 2), (SHM_BUF, 4), ("x", 4), ([5], 4), ([{"kind": "nfs"}], 4),
    ([{"path": "/dev/shm/x", "size": 1}], 4),
    ([{"kind": "shm", "path": "/dev/shm/x"}], 4),
    ([{**SHM_BUF, "offset": 0}], 4),
    ([{**SHM_BUF, "size": -1}], 4), ([{**SHM_BUF, "size": True}], 4),
    ([{**SHM_BUF, "path": 5}], 4), ([SHM_BUF, {**CUDA_BUF, "handle": b"\0" * 63}], 4),
    ([{**CUDA_BUF, "handle": "\0" * 64}], 4), ([{**CUDA_BUF, "handle": b"\0" * 65}], 4),
    ([{**CUDA_BUF, "device_uuid": 0}], 4), ([{k: v for k, v in CUDA_BUF.items() if k != "offset"}], 4),
], ids=["empty", "too-many", "not-list", "str", "item-int", "bad-kind", "no-kind", "shm-no-size",
        "shm-extra", "neg-size", "bool-size", "int-path", "handle-63", "handle-str",
        "handle-65", "uuid-int", "cuda-no-offset"])
def test_buffers_maps_are_strict(items, maxn):
    with pytest.raises(BadRequest, match="buffers"):
        P.buffers_from_wire(items, maxn)


def test_flags_map():
    spec, layout = P.flags_from_wire(dict(FLAGS), 2)
    assert spec == FLAGS and (layout.num_layers, layout.slots, layout.size) == (2, 8, 4096)
    big = {**FLAGS, "slots": 256, "size": FlagLayout(128, 256).size}
    assert P.flags_from_wire(big, 128)[1].words == 8 + 256 * (128 + 4)
    for bad in ({**FLAGS, "size": 8192}, {**FLAGS, "slots": 0}, {**FLAGS, "slots": 257},
                {**FLAGS, "extra": 1}, {"path": "/x", "size": 4096}, [FLAGS], {**FLAGS, "path": 5}):
        with pytest.raises(BadRequest, match="flags"):
            P.flags_from_wire(bad, 2)


def test_register_maps_survive_msgpack():
    fields, frames = SAMPLES["register"]
    req = P.parse_request(P.encode_request(1, "register", fields, frames), P.OPS)
    assert isinstance(req.fields["buffers"][1]["handle"], bytes)
    P.buffers_from_wire(req.fields["buffers"], 4)
    P.layout_from_wire(req.fields["layout"])
    P.namespace_from_wire(req.fields["namespace"], 16)


def test_part_tokens_are_checked_against_the_registration():
    assert P.part_tokens_from_wire(8, 16, 4) == 8
    assert P.part_tokens_from_wire(3, 16, None) == 3  # attach: no page size to check
    for bad in (0, 16, 17, 6, -4, True, 8.0, "8", None, 2**64):
        with pytest.raises(BadRequest, match="part_tokens"):
            P.part_tokens_from_wire(bad, 16, 4)
    assert P.part_candidates_from_wire([12, 8, 4], 16, 4, 5) == [12, 8, 4]
    for bad in ([], [8] * 6, [8] * (P.MAX_PART_CANDIDATES + 1), 8, "8", None, [8, 0], [[8]]):
        with pytest.raises(BadRequest, match="part_tokens"):
            P.part_candidates_from_wire(bad, 16, 4, 5 if len(str(bad)) < 100 else 10**4)
