"""Unit tests, no daemon: kvd/protocol.py, kvd/layout.py, kvd/allocator.py, kvd/config.py."""

from __future__ import annotations

import math
import random
import struct

import msgpack
import numpy as np
import pytest

from kvd import layout as L
from kvd import protocol as P
from kvd.allocator import ExtentAllocator
from kvd.config import KNOB_BY_NAME, KNOBS, load_config, parse_size
from kvd.errors import (SERVER_ERRORS, BadRequest, ConfigError, ServerError, TooLarge, UnknownOp,
                        VersionMismatch)
from kvd.keys import Namespace

# ============================================================================
# protocol
# ============================================================================

NS_WIRE = {"model": "org/m", "kv_dtype": "float16", "attention": "mha", "num_layers": 2,
           "kv_heads": 2, "head_dim": 4, "tp_size": 1}
LAYOUT_WIRE = {"num_layers": 2, "planes": 2, "num_pages": 4, "page_size": 4, "row_bytes": 16,
               "page_stride": 64, "token_stride": 16, "bases": [[0, 0], [0, 256], [0, 512], [0, 768]]}
SHM_BUF = {"kind": "shm", "path": "/dev/shm/kvd-pool-1-abc", "size": 1024}
CUDA_BUF = {"kind": "cuda_ipc", "handle": bytes(range(64)), "offset": 0, "size": 1024,
            "device_uuid": "GPU-00000000-0000-0000-0000-000000000000"}
KEYS2 = bytes(range(32))
PAGES = P.pages_frame([0, 1, 2, 3])

# every op with a full set of valid fields (required and optional) and frames
SAMPLES = {
    "hello": ({"client": "test", "pid": 123, "versions": [1]}, []),
    "register": ({"namespace": NS_WIRE, "tp_rank": 0, "buffers": [SHM_BUF, CUDA_BUF],
                  "layout": LAYOUT_WIRE, "events": [b"\x01" * 64, b"\x02" * 64]}, []),
    "unregister": ({"reg": 5}, []),
    "lookup": ({"reg": 5, "lease_ms": 100}, [KEYS2]),
    "store": ({"reg": 5, "event": 1, "deadline_us": 10**12}, [KEYS2, PAGES]),
    "load": ({"reg": 5, "lease": 9, "layerwise": True, "deadline_us": 10**12}, [KEYS2, PAGES]),
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
    assert msgpack.unpackb(parts[0]) == {"v": 1, "id": 3, "op": "release", "lease": 4}
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


def test_unknown_op():
    expect_error([_header(v=1, id=4, op="frobnicate")], "unknown_op", 4)
    expect_error([_header(v=1, id=4, op=7)], "unknown_op", 4)
    expect_error([_header(v=1, id=4)], "unknown_op", 4)
    # each socket has its own ops
    expect_error(P.encode_request(5, "stats"), "unknown_op", 5, ops=P.OPS)
    expect_error(P.encode_request(6, "heartbeat"), "unknown_op", 6, ops=P.CONTROL_OPS)
    assert UnknownOp.code == "unknown_op"


@pytest.mark.parametrize("v", [2, 0, None, "1", 1.0, True, [1], -1],
                         ids=["2", "0", "nil", "str", "float", "bool", "list", "negative"])
def test_bad_version(v):
    fields = {"id": 8, "op": "heartbeat"}
    if v is not None:
        fields["v"] = v
    expect_error([_header(**fields)], "bad_version", 8)
    assert VersionMismatch.code == "bad_version"


@pytest.mark.parametrize("req_id", [None, -1, True, "1", 1.5, 2**64 - 1],
                         ids=["missing", "negative", "bool", "str", "float", "above-2**63-1"])
def test_bad_id(req_id):
    fields = {"v": 1, "op": "heartbeat"}
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
    header = _header(v=1, id=13, op="heartbeat", **{"x": 1}).replace(b"\xa1x", b"\xc4\x01x")
    expect_error([header], "bad_request", 13, match="unknown field")


@pytest.mark.parametrize("op,field,value", [
    ("unregister", "reg", True), ("unregister", "reg", False), ("unregister", "reg", -1),
    ("unregister", "reg", "5"), ("unregister", "reg", 5.0), ("unregister", "reg", None),
    ("unregister", "reg", 2**64 - 1), ("unregister", "reg", [5]),
    ("lookup", "lease_ms", True), ("lookup", "lease_ms", -5), ("load", "lease", "9"),
    ("hello", "client", 1), ("hello", "pid", -1), ("hello", "versions", 1),
    ("hello", "versions", "1"), ("register", "namespace", [1]), ("register", "layout", "x"),
    ("register", "buffers", {"kind": "shm"}), ("register", "tp_rank", True),
    ("register", "events", b"\0" * 64), ("store", "event", True), ("store", "event", -1),
    ("load", "layerwise", 1), ("load", "layerwise", "true"), ("load", "layerwise", None),
], ids=lambda x: repr(x)[:12])
def test_wrong_type(op, field, value):
    fields, frames = SAMPLES[op]
    expect_error(P.encode_request(14, op, {**fields, field: value}, frames), "bad_request", 14,
                 match=f"field '{field}' must be")


def test_type_limits_accepted():
    fields, frames = SAMPLES["lookup"]
    P.parse_request(P.encode_request(1, "lookup", {**fields, "lease_ms": 0}, frames), P.OPS)
    P.parse_request(P.encode_request(1, "hello", {"client": "c" * 4096, "pid": 2**63 - 1,
                                                  "versions": [1]}), P.OPS)
    P.parse_request(P.encode_request(1, "unregister", {"reg": 0}), P.OPS)


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
    expect_error([msgpack.packb({1: 2, "v": 1, "id": 3, "op": "bye"})], "bad_request", None)


def test_too_many_map_entries_are_malformed():
    fields = {f"f{i}": i for i in range(70)}
    expect_error([_header(v=1, id=3, op="bye", **fields)], "bad_request", None)


def test_too_long_array_is_malformed():
    fields, _ = SAMPLES["hello"]
    expect_error(P.encode_request(3, "hello", {**fields, "versions": [1] * 70000}),
                 "bad_request", None)


@pytest.mark.parametrize("ext", [msgpack.ExtType(5, b"abc"), msgpack.ExtType(127, b"x" * 300),
                                 msgpack.Timestamp(1, 0)], ids=["ext", "ext16", "timestamp"])
def test_msgpack_ext_types_are_refused(ext):
    header = msgpack.packb({"v": 1, "id": 3, "op": "hello", "client": "c", "pid": 1,
                            "versions": [1, ext]}, datetime=False)
    expect_error([header], "bad_request", None, match="malformed msgpack")


def test_zero_length_ext_is_refused():
    header = (b"\x86" + b"".join(msgpack.packb(x) for x in ("v", 1, "id", 3, "op", "hello",
                                                            "client", "c", "pid", 1, "versions"))
              + b"\x92\x01\xc7\x00\x05")  # versions: [1, ExtType(5, b"")]
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
    exc = expect_error([_header(v=1, id="x", op="heartbeat")], "bad_request", None)
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
    lambda m: m.update(tp_size=2**31),
], ids=["no-model", "no-tp", "chunk_tokens", "extra", "str-int", "bool-int", "negative",
        "int-str", "bad-dtype", "mla-with-2-heads", "zero-layers", "empty-model", "tp-too-big"])
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


def test_events_list():
    handles = [b"\x07" * 64] * 3
    assert P.events_from_wire(handles, 3) == handles
    assert P.events_from_wire([], 3) == []
    for bad in ([b"\0" * 64] * 4, [b"\0" * 63], ["\0" * 64], b"\0" * 64, [None]):
        with pytest.raises(BadRequest, match="event"):
            P.events_from_wire(bad, 3)


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
    assert msgpack.unpackb(parts[0]) == {"v": 1, "id": 9,
                                         "result": {"hits": 3, "lease": None,
                                                    "namespace": b"\x01" * 16}}
    assert P.parse_reply(parts) == (9, {"hits": 3, "lease": None, "namespace": b"\x01" * 16})


@pytest.mark.parametrize("code", sorted(SERVER_ERRORS))
def test_error_reply_raises_typed_error(code):
    parts = P.error_reply(21, code, f"message of {code}")
    assert msgpack.unpackb(parts[0]) == {"v": 1, "id": 21,
                                         "error": {"code": code, "message": f"message of {code}"}}
    with pytest.raises(SERVER_ERRORS[code], match=f"message of {code}") as info:
        P.parse_reply(parts)
    assert type(info.value) is SERVER_ERRORS[code]
    assert info.value.code == code and info.value.req_id == 21


def test_error_codes_are_distinct_and_documented():
    from pathlib import Path
    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    assert len(SERVER_ERRORS) == 13
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
        P.parse_reply([P.pack({"v": 1, "id": 3, "error": "oops"})])
    assert info.value.code == "internal"


@pytest.mark.parametrize("raw", [P.pack([1]), P.pack({"v": 1, "id": "x", "result": {}}),
                                 P.pack({"v": 1, "id": -1, "result": {}})])
def test_malformed_reply(raw):
    with pytest.raises(BadRequest):
        P.parse_reply([raw])
    with pytest.raises(BadRequest):
        P.parse_reply([b"\xc1"])


# ============================================================================
# layout descriptors
# ============================================================================

ITEM = 2  # float16


class Pool:
    """Tensors placed inside one random uint8 buffer, like a registered shm file."""

    def __init__(self, shapes, seed=0):
        sizes = [int(np.prod(s)) * ITEM for s in shapes]
        self.offsets = list(np.cumsum([0] + [s + 64 for s in sizes])[:-1])  # 64-byte gaps
        self.raw = np.random.default_rng(seed).integers(0, 256, sum(sizes) + 64 * len(sizes),
                                                        dtype=np.uint8)
        self.tensors = [self.raw[o:o + n].view(np.float16).reshape(s)
                        for o, n, s in zip(self.offsets, sizes, shapes)]
        self.refs = [L.TensorRef(0, int(o), tuple(s), t.strides, ITEM)
                     for o, s, t in zip(self.offsets, shapes, self.tensors)]

    def row(self, d: L.LayoutDescriptor, layer, plane, page, token) -> bytes:
        buf, off = d.base(layer, plane)
        assert buf == 0
        start = off + page * d.page_stride + token * d.token_stride
        return self.raw[start:start + d.row_bytes].tobytes()


def _check_every_row(pool: Pool, d: L.LayoutDescriptor, expect):
    """expect(layer, plane, page, token) -> the numpy row the descriptor must address."""
    d.validate_extent([pool.raw.size])
    for layer in range(d.num_layers):
        for plane in range(d.planes):
            for page in range(d.num_pages):
                for token in range(d.page_size):
                    want = np.ascontiguousarray(expect(layer, plane, page, token)).tobytes()
                    assert len(want) == d.row_bytes
                    assert pool.row(d, layer, plane, page, token) == want, (layer, plane, page, token)


LAYERS, PAGES_N, PS, HEADS, DIM = 3, 5, 4, 2, 8


def test_vllm_flash_attn():
    pool = Pool([(2, PAGES_N, PS, HEADS, DIM)] * LAYERS)
    d = L.vllm_flash_attn(pool.refs)
    s = pool.tensors[0].strides
    assert (d.num_layers, d.planes, d.num_pages, d.page_size) == (LAYERS, 2, PAGES_N, PS)
    assert (d.row_bytes, d.page_stride, d.token_stride) == (HEADS * DIM * ITEM, s[1], s[2])
    assert d.bases[1] == (0, pool.offsets[0] + s[0]) and d.bases[2] == (0, pool.offsets[1])
    _check_every_row(pool, d, lambda l, p, g, t: pool.tensors[l][p, g, t])


def test_vllm_flashinfer():
    pool = Pool([(PAGES_N, 2, PS, HEADS, DIM)] * LAYERS, seed=1)
    d = L.vllm_flashinfer(pool.refs)
    s = pool.tensors[0].strides
    assert (d.planes, d.num_pages, d.page_size, d.page_stride, d.token_stride) == \
        (2, PAGES_N, PS, s[0], s[2])
    assert d.bases[:2] == ((0, pool.offsets[0]), (0, pool.offsets[0] + s[1]))
    _check_every_row(pool, d, lambda l, p, g, t: pool.tensors[l][g, p, t])


def test_vllm_mla():
    pool = Pool([(PAGES_N, PS, 24)] * LAYERS, seed=2)
    d = L.vllm_mla(pool.refs)
    assert (d.planes, d.num_pages, d.page_size, d.row_bytes) == (1, PAGES_N, PS, 24 * ITEM)
    assert d.bases == tuple((0, o) for o in pool.offsets)
    _check_every_row(pool, d, lambda l, p, g, t: pool.tensors[l][g, t])


def test_sglang_mha():
    tokens = PAGES_N * PS + 3  # a partial last page is left unused
    pool = Pool([(tokens, HEADS, DIM)] * (2 * LAYERS), seed=3)
    k, v = pool.tensors[0::2], pool.tensors[1::2]
    d = L.sglang_mha(pool.refs[0::2], pool.refs[1::2], PS)
    s = pool.tensors[0].strides
    assert (d.planes, d.num_pages, d.page_size) == (2, PAGES_N, PS)
    assert (d.page_stride, d.token_stride) == (PS * s[0], s[0])
    assert d.bases == tuple((0, o) for o in pool.offsets)  # K0, V0, K1, V1, ...
    _check_every_row(pool, d, lambda l, p, g, t: (k, v)[p][l][g * PS + t])


def test_sglang_mla():
    pool = Pool([(PAGES_N * PS, 1, 24)] * LAYERS, seed=4)
    d = L.sglang_mla(pool.refs, PS)
    assert (d.planes, d.num_pages, d.row_bytes, d.page_stride) == (1, PAGES_N, 48, PS * 48)
    _check_every_row(pool, d, lambda l, p, g, t: pool.tensors[l][g * PS + t])


def test_page_first():
    pool = Pool([(PAGES_N, LAYERS, 2, PS, HEADS, DIM)], seed=5)
    d = L.page_first(pool.refs[0])
    s = pool.tensors[0].strides
    assert (d.num_layers, d.planes, d.num_pages, d.page_size) == (LAYERS, 2, PAGES_N, PS)
    assert (d.page_stride, d.token_stride) == (s[0], s[3])
    assert d.bases[3] == (0, pool.offsets[0] + 1 * s[1] + 1 * s[2])
    _check_every_row(pool, d, lambda l, p, g, t: pool.tensors[0][g, l, p, t])


def test_tensor_in_other_buffer_and_offset():
    ref = L.TensorRef(3, 4096, (2, 4, 2, 1, 8), (64 * 2, 16 * 2, 8 * 2, 8 * 2, 2), 2)
    d = L.vllm_flash_attn([ref])
    assert d.bases == ((3, 4096), (3, 4096 + 128))
    assert d.row_bytes == 16


def test_layout_names():
    assert set(L.LAYOUTS) == {"vllm_flash_attn", "vllm_flashinfer", "vllm_mla", "sglang_mha",
                              "sglang_mla", "page_first"}
    assert all(callable(getattr(L, name)) for name in L.LAYOUTS)


def test_describe_by_name():
    pool = Pool([(2, PAGES_N, PS, HEADS, DIM)] * LAYERS)
    assert L.describe("vllm_flash_attn", pool.refs) == L.vllm_flash_attn(pool.refs)
    tok = Pool([(PAGES_N * PS, HEADS, DIM)] * (2 * LAYERS))
    assert L.describe("sglang_mha", tok.refs, PS) == L.sglang_mha(tok.refs[0::2], tok.refs[1::2], PS)
    with pytest.raises(ValueError, match="page_size"):
        L.describe("sglang_mha", tok.refs)
    pf = Pool([(PAGES_N, LAYERS, 2, PS, HEADS, DIM)])
    assert L.describe("page_first", pf.refs) == L.page_first(pf.refs[0])
    with pytest.raises(ValueError):
        L.describe("page_first", pf.refs * 2)
    with pytest.raises(ValueError, match="unknown layout"):
        L.describe("tensorrt_llm", pool.refs)


def _ref(shape, buffer=0, offset=0):
    t = np.empty(shape, dtype=np.float16)
    return L.TensorRef(buffer, offset, tuple(shape), t.strides, 2)


@pytest.mark.parametrize("build", [
    lambda: L.vllm_flash_attn([]),
    lambda: L.vllm_flash_attn([_ref((3, 4, 4, 2, 8))]),
    lambda: L.vllm_flash_attn([_ref((4, 4, 2, 8))]),
    lambda: L.vllm_flash_attn([_ref((2, 4, 4, 2, 8)), _ref((2, 5, 4, 2, 8))]),
    lambda: L.vllm_flashinfer([_ref((4, 3, 4, 2, 8))]),
    lambda: L.vllm_flashinfer([_ref((4, 2, 4, 16))]),
    lambda: L.vllm_mla([_ref((4, 4, 2, 8))]),
    lambda: L.vllm_mla([_ref((0, 4, 8))]),
    lambda: L.sglang_mha([_ref((16, 2, 8))], [], 4),
    lambda: L.sglang_mha([_ref((16, 2, 8))], [_ref((16, 4, 8))], 4),
    lambda: L.sglang_mha([_ref((16, 2, 8))], [_ref((16, 2, 8))], 32),
    lambda: L.sglang_mha([_ref((16, 2, 8))], [_ref((16, 2, 8))], 0),
    lambda: L.sglang_mha([], [], 4),
    lambda: L.sglang_mla([_ref((16, 2, 8))], 4),
    lambda: L.sglang_mla([_ref((16, 8))], 4),
    lambda: L.page_first(_ref((4, 2, 3, 4, 2, 8))),
    lambda: L.page_first(_ref((4, 2, 2, 4, 2))),
    lambda: L.page_first(_ref((4, 0, 2, 4, 2, 8))),
    lambda: L.page_first(_ref((4, 1025, 2, 1, 1, 1))),
], ids=["fa-empty", "fa-dim0", "fa-rank", "fa-mixed", "fi-dim1", "fi-rank", "mla-rank",
        "mla-no-pages", "sg-kv-count", "sg-kv-shape", "sg-page-too-big", "sg-page-0", "sg-empty",
        "sgmla-dim1", "sgmla-rank", "pf-dim2", "pf-rank", "pf-no-layers", "pf-too-many-layers"])
def test_invalid_shapes_raise_value_error(build):
    with pytest.raises(ValueError):
        build()


def test_non_contiguous_rows_raise_value_error():
    # an HND tensor [2, blocks, heads, block, dim] viewed as NHD: heads x dim not contiguous
    hnd = np.empty((2, 4, 2, 4, 8), dtype=np.float16).transpose(0, 1, 3, 2, 4)
    with pytest.raises(ValueError, match="contiguous"):
        L.vllm_flash_attn([L.TensorRef(0, 0, hnd.shape, hnd.strides, 2)])
    # a strided last dim is not contiguous either
    strided = np.empty((4, 4, 32), dtype=np.float16)[:, :, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        L.vllm_mla([L.TensorRef(0, 0, strided.shape, strided.strides, 2)])
    # ...but padding after each row is fine (the row itself is contiguous)
    padded = np.empty((4, 4, 32), dtype=np.float16)[:, :, :24]
    d = L.vllm_mla([L.TensorRef(0, 0, padded.shape, padded.strides, 2)])
    assert (d.row_bytes, d.token_stride, d.page_stride) == (48, 64, 256)
    # ...but padding between tokens (outer dims) is fine
    gap = np.empty((16, 2, 16), dtype=np.float16)[:, :, :8][:, :1, :]
    d = L.sglang_mla([L.TensorRef(0, 0, gap.shape, gap.strides, 2)], 4)
    assert d.row_bytes == 16 and d.token_stride == 64


@pytest.mark.parametrize("kw", [
    {"planes": 3}, {"planes": 0}, {"num_layers": 0}, {"num_pages": 0}, {"page_size": 0},
    {"row_bytes": 0}, {"page_stride": -1}, {"token_stride": -1}, {"bases": ((0, 0),) * 3},
    {"bases": ((0, -1),) * 4}, {"bases": ((-1, 0),) * 4},
    {"num_layers": 1025, "bases": ((0, 0),) * 2050},
])
def test_descriptor_validation(kw):
    base = dict(num_layers=2, planes=2, num_pages=4, page_size=4, row_bytes=16, page_stride=64,
                token_stride=16, bases=((0, 0),) * 4)
    L.LayoutDescriptor(**base)
    with pytest.raises(ValueError):
        L.LayoutDescriptor(**{**base, **kw})


def test_validate_extent_and_shard_bytes():
    d = L.LayoutDescriptor(2, 2, num_pages=4, page_size=4, row_bytes=16, page_stride=100,
                           token_stride=20, bases=((0, 0), (0, 400), (1, 0), (1, 7)))
    span = 3 * 100 + 3 * 20 + 16
    assert d.plane_span() == span
    d.validate_extent([400 + span, 7 + span])  # exact fit
    with pytest.raises(ValueError, match="base 1"):
        d.validate_extent([400 + span - 1, 7 + span])
    with pytest.raises(ValueError, match="base 3"):
        d.validate_extent([400 + span, 7 + span - 1])
    with pytest.raises(ValueError, match="buffer 1"):
        d.validate_extent([10**6])
    assert d.shard_bytes(8) == 2 * 2 * 8 * 16
    assert d.base(1, 1) == (1, 7)
    assert L.CANONICAL_VERSION == 1


def test_constructed_layouts_fit_exactly():
    # the last byte of the last row of each tensor is reachable and inside the buffer
    for shapes, build in [([(2, 5, 4, 2, 8)] * 2, lambda r: L.vllm_flash_attn(r)),
                          ([(5, 2, 4, 2, 8)] * 2, lambda r: L.vllm_flashinfer(r)),
                          ([(5, 4, 24)] * 2, lambda r: L.vllm_mla(r))]:
        pool = Pool(shapes)
        d = build(pool.refs)
        d.validate_extent([pool.raw.size])
        last = pool.offsets[-1] + int(np.prod(shapes[-1])) * ITEM
        with pytest.raises(ValueError):
            d.validate_extent([last - 1])


# ============================================================================
# extent allocator
# ============================================================================

def test_alloc_aligned_and_sequential():
    a = ExtentAllocator(4096, align=256)
    offs = [a.alloc(n) for n in (1, 256, 257, 0)]
    assert offs == [0, 256, 512, 1024]
    assert a.used == 256 + 256 + 512 + 256
    assert all(o % 256 == 0 for o in offs)
    assert a.rounded(257) == 512 and a.rounded(256) == 256


def test_capacity_rounded_down_and_never_exceeded():
    a = ExtentAllocator(1000, align=256)
    assert a.capacity == 768
    assert a.alloc(769) is None
    assert a.alloc(768) == 0
    assert a.alloc(1) is None
    assert ExtentAllocator(100, align=256).alloc(1) is None


def test_free_coalesces_neighbours():
    a = ExtentAllocator(4 * 256, align=256)
    slots = [a.alloc(256) for _ in range(4)]
    assert slots == [0, 256, 512, 768] and a.alloc(1) is None
    a.free(256, 256)
    a.free(768, 256)
    assert a.largest_free() == 256
    assert a.alloc(512) is None  # free space is fragmented
    a.free(512, 256)  # merges with both neighbours
    assert a.largest_free() == 768
    assert a.alloc(768) == 256
    a.free(256, 768)
    a.free(0, 256)
    assert a.used == 0 and a.largest_free() == 1024
    assert a.alloc(1024) == 0


def test_exact_size_slot_reuse():
    a = ExtentAllocator(10 * 512, align=256)
    offs = [a.alloc(512) for _ in range(10)]
    a.free(offs[6], 512)
    assert a.alloc(512) == offs[6]


def test_mixed_sizes_take_the_smallest_fitting_extent():
    a = ExtentAllocator(8 * 256, align=256)
    offs = [a.alloc(n) for n in (512, 256, 1024, 256)]
    assert offs == [0, 512, 768, 1792]
    a.free(0, 512)
    a.free(768, 1024)
    assert a.alloc(256) == 0  # best fit: the 512-byte hole, not the 1024-byte one
    assert a.alloc(1024) == 768


def _free_runs(taken: np.ndarray, align: int) -> int:
    """Longest run of free aligned units in the byte map, in bytes."""
    free = ~taken.reshape(-1, align).any(axis=1)
    edges = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return int((ends - starts).max(initial=0)) * align


@pytest.mark.parametrize("align,seed", [(256, 0), (64, 1), (8, 2)])
def test_random_alloc_free_never_overlaps(align, seed):
    rng = random.Random(seed)
    capacity = 64 * 1024 + 37
    a = ExtentAllocator(capacity, align)
    taken = np.zeros(a.capacity, dtype=bool)
    live = {}
    for step in range(1500):
        if live and (rng.random() < 0.45 or len(live) > 60):
            start = rng.choice(list(live))
            size = live.pop(start)
            assert taken[start:start + a.rounded(size)].all()
            taken[start:start + a.rounded(size)] = False
            a.free(start, size)
        else:
            size = rng.choice([rng.randrange(1, 4096), 2048, 512, rng.randrange(1, 20000)])
            need = a.rounded(size)
            fits = _free_runs(taken, align) >= need
            start = a.alloc(size)
            if start is None:
                assert not fits, f"step {step}: {need} bytes were free in one run but alloc failed"
                continue
            assert fits
            assert start % align == 0 and start + need <= a.capacity
            assert not taken[start:start + need].any(), f"step {step}: overlap at {start}"
            taken[start:start + need] = True
            live[start] = size
        assert a.used == int(taken.sum()) <= a.capacity
        assert a.largest_free() == _free_runs(taken, align)
    for start, size in live.items():
        a.free(start, size)
    assert a.used == 0 and a.largest_free() == a.capacity


# ============================================================================
# config
# ============================================================================

def test_defaults():
    cfg = load_config(env={})
    assert cfg.as_dict() == {k.name: k.default for k in KNOBS}
    assert cfg.chunk_tokens == 256 and cfg.host_capacity == 2**30
    assert cfg.max_message_bytes == 64 * 2**20 and cfg.log_level == "info"
    with pytest.raises(AttributeError):
        cfg.no_such_knob


def _toml(tmp_path, text):
    p = tmp_path / "kvd.toml"
    p.write_text(text)
    return str(p)


def test_toml_file(tmp_path):
    path = _toml(tmp_path, 'host_capacity = "2GiB"\nchunk_tokens = 64\nclient_timeout_s = 9\n'
                           'shm_dir = "/tmp"\n')
    cfg = load_config(path, env={})
    assert (cfg.host_capacity, cfg.chunk_tokens, cfg.client_timeout_s, cfg.shm_dir) == \
        (2 * 2**30, 64, 9.0, "/tmp")
    assert isinstance(cfg.client_timeout_s, float)
    assert cfg.max_clients == KNOB_BY_NAME["max_clients"].default


def test_precedence_default_toml_env_cli(tmp_path):
    path = _toml(tmp_path, "chunk_tokens = 64\nmax_clients = 7\nlease_max_ms = 5\n")
    env = {"KVD_CHUNK_TOKENS": "32", "KVD_MAX_CLIENTS": "8", "KVD_UNRELATED": "x", "HOME": "/"}
    cfg = load_config(path, env=env, overrides={"chunk_tokens": "16", "max_clients": None})
    assert cfg.chunk_tokens == 16  # CLI beats env beats TOML
    assert cfg.max_clients == 8  # env beats TOML; a None override is "not given"
    assert cfg.lease_max_ms == 5  # TOML beats default
    assert cfg.copy_threads == 2  # default


def test_env_is_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("KVD_MAX_REGISTRATIONS", "3")
    assert load_config().max_registrations == 3
    assert load_config(env={}).max_registrations == 64


@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("1GiB", 2**30), ("512 MiB", 512 * 2**20), (" 1.5KiB ", 1536),
    ("1kb", 1000), ("2G", 2 * 10**9), ("3TB", 3 * 10**12), ("1tib", 2**40), ("7b", 7),
    (12345, 12345), ("0", 0),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["lots", "1 XB", "-1", "", "GiB", "1e3", "1,000", True, 1.5, None])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("source,key,value", [
    ("toml", "chunk_tokens", '"abc"'), ("toml", "chunk_tokens", "16.5"),
    ("toml", "chunk_tokens", "0"), ("toml", "chunk_tokens", "true"),
    ("toml", "host_capacity", '"lots"'), ("toml", "host_capacity", "100"),
    ("toml", "host_capacity", "false"), ("toml", "log_level", '"loud"'),
    ("toml", "shm_dir", "5"), ("toml", "heartbeat_interval_s", '"soon"'),
    ("toml", "heartbeat_interval_s", "0.01"), ("toml", "heartbeat_interval_s", "true"),
    ("env", "chunk_tokens", "abc"), ("env", "chunk_tokens", "1.5"), ("env", "max_clients", "0"),
    ("env", "host_capacity", "1 XB"), ("env", "lease_max_ms", ""), ("env", "log_level", "INFO"),
    ("cli", "max_keys_per_request", "many"), ("cli", "client_timeout_s", "-3"),
    ("cli", "max_message_bytes", "1KiB"),
])
def test_bad_value_names_the_key(tmp_path, source, key, value):
    kwargs = {"env": {}}
    if source == "toml":
        kwargs["path"] = _toml(tmp_path, f"{key} = {value}\n")
    elif source == "env":
        kwargs["env"] = {f"KVD_{key.upper()}": value}
    else:
        kwargs["overrides"] = {key: value}
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")
    origin = {"toml": "kvd.toml", "env": "environment", "cli": "command line"}[source]
    assert origin in str(info.value)


def test_unknown_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, "chunk_size = 16\n"), env={})
    assert info.value.key == "chunk_size" and "unknown key" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, "[server]\nchunk_tokens = 16\n"), env={})
    assert info.value.key == "server"
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"bogus": "1"})
    assert info.value.key == "bogus"


def test_unreadable_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path / "missing.toml"), env={})
    assert info.value.key == "config"
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, "chunk_tokens = = 3\n"), env={})
    assert info.value.key == "config" and "TOML" in str(info.value)


def test_timeout_must_exceed_heartbeat():
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVD_HEARTBEAT_INTERVAL_S": "2", "KVD_CLIENT_TIMEOUT_S": "2"})
    assert info.value.key == "client_timeout_s"
    cfg = load_config(env={"KVD_HEARTBEAT_INTERVAL_S": "2", "KVD_CLIENT_TIMEOUT_S": "2.5"})
    assert math.isclose(cfg.client_timeout_s, 2.5)


def test_every_knob_has_an_env_and_cli_spelling():
    for knob in KNOBS:
        value = {"size": "8MiB", "int": "3", "float": "0.5", "str": "/x", "bool": "true"}[knob.kind]
        if knob.choices:
            value = knob.choices[-1]
        if knob.name == "client_timeout_s":
            value = "10"
        got = load_config(env={f"KVD_{knob.name.upper()}": value}).as_dict()[knob.name]
        assert got == load_config(env={}, overrides={knob.name: value}).as_dict()[knob.name]
