"""The wire format of kvd_protocol.wire: framing, validation, strict maps, replies (no daemon)."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from kvd_protocol import layout as L
from kvd_protocol import wire as P
from kvd_protocol.errors import (
    SERVER_ERRORS,
    BadRequest,
    ServerError,
    TooLarge,
    UnknownOp,
    VersionMismatch,
)
from kvd_protocol.flags import FlagLayout
from kvd_protocol.keys import Namespace

NS_WIRE = {"model": "org/m", "kv_dtype": "float16", "attention": "mha", "num_layers": 2,
           "kv_heads": 2, "head_dim": 4, "tp_size": 1, "first_layer": 0, "fingerprint": ""}
LAYOUT_WIRE = {"num_layers": 2, "planes": 2, "num_pages": 4, "page_size": 4, "row_bytes": 16,
               "page_stride": 64, "token_stride": 16, "bases": [[0, 0], [0, 256], [0, 512], [0, 768]]}
SHM_BUF = {"kind": "shm", "path": "/dev/shm/kvd-pool-1-abc", "size": 1024}
CUDA_BUF = {"kind": "cuda_ipc", "handle": bytes(range(64)), "offset": 0, "size": 1024,
            "device_uuid": "GPU-00000000-0000-0000-0000-000000000000"}
FLAGS = {"path": "/dev/shm/kvd-flags-1-abc", "size": 4096, "slots": 8}
KEYS2 = bytes(range(32))
PAGES = P.pages_frame([0, 1, 2, 3])

# every op with a full set of valid fields (required and optional) and frames
SAMPLES = {
    "hello": ({"client": "test", "pid": 123, "versions": [2]}, []),
    "register": ({"namespace": NS_WIRE, "tp_rank": 0, "buffers": [SHM_BUF, CUDA_BUF],
                  "layout": LAYOUT_WIRE, "flags": FLAGS}, []),
    "attach": ({"namespace": NS_WIRE, "tp_rank": 0}, []),
    "unregister": ({"reg": 5}, []),
    "lookup": ({"reg": 5, "lease_ms": 100, "part_tokens": [4]}, [KEYS2]),
    "store": ({"reg": 5, "after": 1, "deadline_us": 10**12, "tenant": "acme", "part_tokens": 4},
              [KEYS2, PAGES]),
    "load": ({"reg": 5, "slot": 3, "seq": 2**32 - 1, "after": 7, "lease": 9, "layerwise": True,
              "deadline_us": 10**12, "tail_pages": 1, "part_tokens": 4}, [KEYS2, PAGES]),
    "release": ({"lease": 9}, []),
    "heartbeat": ({}, []),
    "bye": ({}, []),
}


def test_samples_cover_every_op():
    assert set(SAMPLES) == set(P.OPS)
    assert set(P.CONTROL_OPS) == {"stats", "clear", "health", "flush_disk", "clear_disk"}
    for name, (fields, frames) in SAMPLES.items():
        spec = P.OPS[name]
        assert set(fields) == set(spec.required) | set(spec.optional)
        assert len(frames) == spec.frames


@pytest.mark.parametrize("op", sorted(P.OPS))
def test_round_trip_engine_ops(op):
    fields, frames = SAMPLES[op]
    parts = P.encode_request(77, op, fields, frames)
    assert len(parts) == 1 + len(frames)
    assert all(isinstance(p, bytes) for p in parts[:1])
    req = P.parse_request(parts, P.OPS)
    assert (req.id, req.op, req.fields, req.frames) == (77, op, fields, frames)
    # optional fields may be left out
    required = {k: v for k, v in fields.items() if k in P.OPS[op].required}
    req = P.parse_request(P.encode_request(2**63 - 1, op, required, frames), P.OPS)
    assert (req.id, req.fields) == (2**63 - 1, required)


@pytest.mark.parametrize("op", sorted(P.CONTROL_OPS))
def test_round_trip_control_ops(op):
    req = P.parse_request(P.encode_request(0, op), P.CONTROL_OPS)
    assert (req.id, req.op, req.fields, req.frames) == (0, op, {}, [])


def test_frames_may_be_memoryviews_or_zmq_like_buffers():
    fields, frames = SAMPLES["store"]
    parts = [memoryview(p) for p in P.encode_request(1, "store", fields, frames)]
    req = P.parse_request(parts, P.OPS)
    assert req.frames == frames and all(type(f) is bytes for f in req.frames)


def test_header_layout_on_the_wire():
    parts = P.encode_request(3, "release", {"lease": 4})
    assert msgpack.unpackb(parts[0]) == {"v": 2, "id": 3, "op": "release", "lease": 4}
    # a str is a msgpack str, bytes are a msgpack bin
    raw = P.pack({"a": "x", "b": b"x"})
    assert msgpack.unpackb(raw, raw=True) == {b"a": b"x", b"b": b"x"}
    assert b"\xa1x" in raw and b"\xc4\x01x" in raw


def _header(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def expect_error(parts, code, req_id=None, ops=P.OPS, match=None):
    """The request must be refused with ``code``; a readable id must be carried."""
    with pytest.raises(ServerError, match=match) as info:
        P.parse_request(parts, ops)
    exc = info.value
    assert exc.code == code, f"expected {code}, got {exc.code}: {exc}"
    assert isinstance(exc, (P.ProtocolError, SERVER_ERRORS[code]))
    assert getattr(exc, "req_id", None) == req_id
    return exc


@pytest.mark.parametrize("tenant", ["x" * 65, "a\nb", "tab\there", 7, b"bytes", None])
def test_a_store_tenant_label_is_a_short_printable_string(tenant):
    fields = {"reg": 5, "tenant": tenant}
    with pytest.raises(P.ProtocolError, match="tenant") as info:
        P.parse_request(P.encode_request(1, "store", fields, [KEYS2, PAGES]), P.OPS)
    assert info.value.code == "bad_request"
    assert P.parse_request(P.encode_request(1, "store", {**fields, "tenant": "é" * 64},
                                            [KEYS2, PAGES]), P.OPS).fields["tenant"] == "é" * 64
    with pytest.raises(ValueError, match="64 printable"):
        P.checked_tenant(tenant if isinstance(tenant, str) else "\x1f")


def test_tenant_label_makes_a_valid_label_of_any_salt():
    assert P.tenant_label(None) is None and P.tenant_label("") is None
    assert P.tenant_label("acme") == "acme"
    assert P.tenant_label("fixed\x1frequest:acme") == "fixed?request:acme"
    assert P.tenant_label("y" * 100) == "y" * 64 and P.valid_tenant(P.tenant_label("\n" * 99))


def test_unknown_op():
    expect_error([_header(v=2, id=4, op="frobnicate")], "unknown_op", 4)
    expect_error([_header(v=2, id=4, op=7)], "unknown_op", 4)
    expect_error([_header(v=2, id=4)], "unknown_op", 4)
    # each socket has its own ops
    expect_error(P.encode_request(5, "stats"), "unknown_op", 5, ops=P.OPS)
    expect_error(P.encode_request(6, "heartbeat"), "unknown_op", 6, ops=P.CONTROL_OPS)
    assert UnknownOp.code == "unknown_op"


@pytest.mark.parametrize("v", [1, 3, 0, None, "2", 2.0, True, [2], -1],
                         ids=["v1", "3", "0", "nil", "str", "float", "bool", "list", "negative"])
def test_bad_version(v):
    fields = {"id": 8, "op": "heartbeat"}
    if v is not None:
        fields["v"] = v
    expect_error([_header(**fields)], "bad_version", 8)
    assert VersionMismatch.code == "bad_version"


@pytest.mark.parametrize("req_id", [None, -1, True, "1", 1.5, 2**64 - 1],
                         ids=["missing", "negative", "bool", "str", "float", "above-2**63-1"])
def test_bad_id(req_id):
    fields = {"v": 2, "op": "heartbeat"}
    if req_id is not None:
        fields["id"] = req_id
    expect_error([_header(**fields)], "bad_request", None, match="id")


@pytest.mark.parametrize("op,drop", [("hello", "client"), ("hello", "versions"),
                                     ("register", "layout"), ("register", "tp_rank"),
                                     ("lookup", "reg"), ("store", "reg"), ("load", "reg"),
                                     ("release", "lease"), ("unregister", "reg")])
def test_missing_field(op, drop):
    fields, frames = SAMPLES[op]
    fields = {k: v for k, v in fields.items() if k != drop}
    expect_error(P.encode_request(11, op, fields, frames), "bad_request", 11,
                 match=f"missing field '{drop}'")


@pytest.mark.parametrize("op,extra", [("heartbeat", {"x": 1}), ("lookup", {"lease": 1}),
                                      ("store", {"lease_ms": 1}), ("hello", {"reg": 1}),
                                      ("bye", {"v2": 1})])
def test_unknown_field(op, extra):
    fields, frames = SAMPLES[op]
    expect_error(P.encode_request(12, op, {**fields, **extra}, frames), "bad_request", 12,
                 match="unknown field")


def test_unknown_bytes_key_is_an_unknown_field():
    header = _header(v=2, id=13, op="heartbeat", **{"x": 1}).replace(b"\xa1x", b"\xc4\x01x")
    expect_error([header], "bad_request", 13, match="unknown field")


@pytest.mark.parametrize("op,field,value", [
    ("unregister", "reg", True), ("unregister", "reg", False), ("unregister", "reg", -1),
    ("unregister", "reg", "5"), ("unregister", "reg", 5.0), ("unregister", "reg", None),
    ("unregister", "reg", 2**64 - 1), ("unregister", "reg", [5]),
    ("lookup", "lease_ms", True), ("lookup", "lease_ms", -5), ("load", "lease", "9"),
    ("hello", "client", 1), ("hello", "pid", -1), ("hello", "versions", 1),
    ("hello", "versions", "1"), ("register", "namespace", [1]), ("register", "layout", "x"),
    ("register", "buffers", {"kind": "shm"}), ("register", "tp_rank", True),
    ("register", "flags", [1]), ("store", "after", True), ("store", "after", -1),
    ("store", "after", 2**32), ("load", "seq", 2**32), ("load", "after", 2**32),
    ("load", "slot", "0"), ("load", "slot", -1),
    ("load", "layerwise", 1), ("load", "layerwise", "true"), ("load", "layerwise", None),
], ids=lambda x: repr(x)[:12])
def test_wrong_type(op, field, value):
    fields, frames = SAMPLES[op]
    expect_error(P.encode_request(14, op, {**fields, field: value}, frames), "bad_request", 14,
                 match=f"field '{field}' must be")


def test_type_limits_accepted():
    fields, frames = SAMPLES["lookup"]
    req = P.parse_request(P.encode_request(1, "lookup", {**fields, "lease_ms": 0}, frames), P.OPS)
    assert (req.id, req.op, req.fields["lease_ms"], len(req.frames)) == (1, "lookup", 0, len(frames))
    hello = {"client": "c" * 4096, "pid": 2**63 - 1, "versions": [2]}
    req = P.parse_request(P.encode_request(2, "hello", hello), P.OPS)
    assert (req.op, {k: req.fields[k] for k in hello}) == ("hello", hello)
    req = P.parse_request(P.encode_request(3, "unregister", {"reg": 0}), P.OPS)
    assert (req.id, req.op, req.fields["reg"]) == (3, "unregister", 0)


@pytest.mark.parametrize("op,count", [("lookup", 0), ("lookup", 2), ("store", 1), ("store", 3),
                                      ("load", 0), ("heartbeat", 1), ("hello", 1)])
def test_frame_count(op, count):
    fields, _ = SAMPLES[op]
    expect_error(P.encode_request(15, op, fields, [b""] * count), "bad_request", 15,
                 match="data frames")


def test_control_frame_count():
    expect_error(P.encode_request(16, "stats", None, [b"x"]), "bad_request", 16,
                 ops=P.CONTROL_OPS)
    expect_error(P.encode_request(16, "health", {"x": 1}), "bad_request", 16, ops=P.CONTROL_OPS)


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"\x83\xa1v", b"\x81\xa1v\x01" + b"\x00",
                                 b"\x81\xa1v\xa2\xff\xfe", b"\xdf\xff\xff\xff\xff"],
                         ids=["empty", "reserved-byte", "truncated", "trailing-data",
                              "invalid-utf8", "huge-map-length"])
def test_malformed_msgpack(raw):
    expect_error([raw], "bad_request", None, match="malformed msgpack")


def test_non_string_map_keys_are_malformed():
    expect_error([msgpack.packb({1: 2, "v": 2, "id": 3, "op": "bye"})], "bad_request", None)


def test_too_many_map_entries_are_malformed():
    fields = {f"f{i}": i for i in range(70)}
    expect_error([_header(v=2, id=3, op="bye", **fields)], "bad_request", None)


def test_too_long_array_is_malformed():
    fields, _ = SAMPLES["hello"]
    expect_error(P.encode_request(3, "hello", {**fields, "versions": [2] * 70000}),
                 "bad_request", None)


@pytest.mark.parametrize("ext", [msgpack.ExtType(5, b"abc"), msgpack.ExtType(127, b"x" * 300),
                                 msgpack.Timestamp(1, 0)], ids=["ext", "ext16", "timestamp"])
def test_msgpack_ext_types_are_refused(ext):
    header = msgpack.packb({"v": 2, "id": 3, "op": "hello", "client": "c", "pid": 1,
                            "versions": [2, ext]}, datetime=False)
    expect_error([header], "bad_request", None, match="malformed msgpack")


def test_zero_length_ext_is_refused():
    header = (b"\x86" + b"".join(msgpack.packb(x) for x in ("v", 2, "id", 3, "op", "hello",
                                                            "client", "c", "pid", 1, "versions"))
              + b"\x92\x02\xc7\x00\x05")  # versions: [2, ExtType(5, b"")]
    expect_error([header], "bad_request", None)


@pytest.mark.parametrize("header", [[1, 2], 5, "hello", None, b"bin", 1.5, True],
                         ids=["array", "int", "str", "nil", "bin", "float", "bool"])
def test_non_map_header(header):
    expect_error([msgpack.packb(header, use_bin_type=True)], "bad_request", None,
                 match="must be a msgpack map")


def test_no_frames_at_all():
    expect_error([], "bad_request", None)


def test_oversized_header():
    fields, _ = SAMPLES["hello"]
    big = P.encode_request(17, "hello", {**fields, "client": "x" * P.MAX_HEADER_BYTES})
    assert len(big[0]) > P.MAX_HEADER_BYTES
    expect_error(big, "too_large", None)
    assert TooLarge.code == "too_large"
    # a header just under the limit is decoded (and refused for its field, with its id)
    ok_size = P.encode_request(17, "hello", {**fields, "client": "x" * (P.MAX_HEADER_BYTES - 200)})
    assert len(ok_size[0]) <= P.MAX_HEADER_BYTES
    expect_error(ok_size, "bad_request", 17, match="client")


def test_protocol_error_carries_request_id():
    exc = expect_error(P.encode_request(4242, "nope"), "unknown_op", 4242)
    assert isinstance(exc, P.ProtocolError) and exc.req_id == 4242
    exc = expect_error(P.encode_request(0, "heartbeat", {"x": 1}), "bad_request", 0)
    assert exc.req_id == 0  # id 0 is a valid id, not "unreadable"
    exc = expect_error([_header(v=2, id="x", op="heartbeat")], "bad_request", None)
    assert isinstance(exc, P.ProtocolError) and exc.req_id is None
    # an error reply built from it goes back with the id
    _, _ = P.parse_reply(P.ok_reply(4242, {}))
    with pytest.raises(UnknownOp) as info:
        P.parse_reply(P.error_reply(4242, "unknown_op", "x"))
    assert info.value.req_id == 4242


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


# ---- replies --------------------------------------------------------------------

def test_ok_reply_round_trip():
    parts = P.ok_reply(9, {"hits": 3, "lease": None, "namespace": b"\x01" * 16})
    assert len(parts) == 1
    assert msgpack.unpackb(parts[0]) == {"v": 2, "id": 9,
                                         "result": {"hits": 3, "lease": None,
                                                    "namespace": b"\x01" * 16}}
    assert P.parse_reply(parts) == (9, {"hits": 3, "lease": None, "namespace": b"\x01" * 16})


@pytest.mark.parametrize("code", sorted(SERVER_ERRORS))
def test_error_reply_raises_typed_error(code):
    parts = P.error_reply(21, code, f"message of {code}")
    assert msgpack.unpackb(parts[0]) == {"v": 2, "id": 21,
                                         "error": {"code": code, "message": f"message of {code}"}}
    with pytest.raises(SERVER_ERRORS[code], match=f"message of {code}") as info:
        P.parse_reply(parts)
    assert type(info.value) is SERVER_ERRORS[code]
    assert info.value.code == code and info.value.req_id == 21


def test_error_codes_are_distinct_and_documented():
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    assert len(SERVER_ERRORS) == 16
    for code, cls in SERVER_ERRORS.items():
        assert cls.code == code
        assert f"| `{code}` | `{cls.__name__}` |" in doc, f"{code} missing from docs/protocol.md"


def test_error_reply_edge_cases():
    with pytest.raises(ServerError) as info:
        P.parse_reply(P.error_reply(None, "bad_request", "unreadable"))
    assert type(info.value) is BadRequest and info.value.req_id is None
    with pytest.raises(ServerError) as info:
        P.parse_reply(P.error_reply(3, "brand_new_code", "later version"))
    assert type(info.value) is ServerError and info.value.code == "brand_new_code"
    with pytest.raises(ServerError) as info:
        P.parse_reply([P.pack({"v": 2, "id": 3, "error": "oops"})])
    assert info.value.code == "internal"


@pytest.mark.parametrize("raw", [P.pack([1]), P.pack({"v": 2, "id": "x", "result": {}}),
                                 P.pack({"v": 2, "id": -1, "result": {}})])
def test_malformed_reply(raw):
    with pytest.raises(BadRequest):
        P.parse_reply([raw])
    with pytest.raises(BadRequest):
        P.parse_reply([b"\xc1"])


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
