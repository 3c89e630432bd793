"""The wire format of kvd_protocol.wire: framing, header validation and replies (no daemon).

Every op's request round-trips; malformed headers, unknown ops and fields,
wrong types and frame counts are refused with typed errors that carry the
request id where it can be read; replies round-trip and raise typed errors.
Bulk frames and the maps of ``register``: test_wire_payloads.py.
"""

from __future__ import annotations

import msgpack
import pytest
from wire_samples import KEYS2, PAGES, SAMPLES

from kvd_protocol import wire as P
from kvd_protocol.errors import (
    SERVER_ERRORS,
    BadRequest,
    ServerError,
    TooLarge,
    UnknownOp,
    VersionMismatch,
)


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

