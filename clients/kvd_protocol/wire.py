"""Wire protocol v2: the only module that knows how messages look on the wire.

A message is ZeroMQ multipart: a msgpack header ``{v, id, op, ...}`` (replies ``{v, id,
result}`` or ``{v, id, error: {code, message}}``) and raw little-endian array frames.
``OPS`` and ``CONTROL_OPS`` list every op's fields and frame count. Everything is validated
here first (fields, types, sizes, depth ``MAX_DEPTH``, frames), raising a ``ServerError``
carrying the request id. Peer values reach messages and logs only through ``describe``
(bounded), never ``repr``. No pickle, no msgpack ext types. A v1 peer gets ``bad_version``.
docs/protocol.md is the prose version.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np

from kvd_protocol.errors import BadRequest, ServerError, TooLarge, UnknownOp, VersionMismatch, server_error
from kvd_protocol.flags import FlagLayout
from kvd_protocol.keys import KEY_BYTES, Namespace
from kvd_protocol.layout import LayoutDescriptor
from kvd_protocol.limits import MAX_BYTES, MAX_FDS, MAX_LAYERS, MAX_TENANT_CHARS

VERSION = 2
SUPPORTED_VERSIONS = (2,)
MAX_HEADER_BYTES = 256 * 1024
MAX_ID = 2**63 - 1
MAX_DEPTH = 16  # containers nested in a header; the deepest valid one (layout.bases) has 4
PAGE_DTYPE = np.dtype("<i8")
DESCRIBE_CHARS = 64  # longest string shown whole in an error message
DESCRIBE_ITEMS = 8  # longest list of scalars shown item by item


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_ID


def _u32(v):
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0xFFFFFFFF


def _str(v):
    return isinstance(v, str) and len(v) <= 4096


def _list(v):
    return isinstance(v, list)


def _map(v):
    return isinstance(v, dict)


def _bool(v):
    return isinstance(v, bool)


def _size(v):
    return _int(v) and v <= MAX_BYTES


def valid_tenant(v) -> bool:
    """A store's ``tenant`` label: a printable string of at most ``MAX_TENANT_CHARS``."""
    return isinstance(v, str) and len(v) <= MAX_TENANT_CHARS and v.isprintable()


def checked_tenant(v: str | None) -> str | None:
    """``v`` when it is None or a valid ``tenant`` label, else ``ValueError``."""
    if v is not None and not valid_tenant(v):
        raise ValueError(f"a tenant label is at most {MAX_TENANT_CHARS} printable characters, "
                         f"got {describe(v)}")
    return v


def tenant_label(text: str | None) -> str | None:
    """A valid ``tenant`` label from any text (a salt): its first ``MAX_TENANT_CHARS``
    characters, each one that is not printable (a separator, a newline) as "?"; None for
    no text. Adapters label their stores with it (docs/protocol.md §5.6)."""
    if not text:
        return None
    return "".join(c if c.isprintable() else "?" for c in text[:MAX_TENANT_CHARS])


_TYPE_NAMES = {_int: "a non-negative integer", _str: "a string", _list: "a list", _map: "a map",
               _bool: "true or false", _u32: "an integer in [0, 2**32)",
               _size: f"an integer between 0 and {MAX_BYTES}",
               valid_tenant: f"a printable string of at most {MAX_TENANT_CHARS} characters"}


@dataclass(frozen=True)
class Op:
    required: dict = field(default_factory=dict)
    optional: dict = field(default_factory=dict)
    frames: int = 0


OPS = {
    "hello": Op({"client": _str, "pid": _int, "versions": _list}),
    "register": Op({"namespace": _map, "tp_rank": _int, "buffers": _list, "layout": _map,
                    "flags": _map}),
    "attach": Op({"namespace": _map, "tp_rank": _int}),
    "unregister": Op({"reg": _int}),
    "lookup": Op({"reg": _int}, {"lease_ms": _int, "part_tokens": _list}, frames=1),
    "store": Op({"reg": _int}, {"after": _u32, "deadline_us": _int, "tenant": valid_tenant,
                                "part_tokens": _int}, frames=2),
    "load": Op({"reg": _int, "slot": _int, "seq": _u32},
               {"after": _u32, "lease": _int, "layerwise": _bool, "deadline_us": _int,
                "tail_pages": _int, "part_tokens": _int}, frames=2),
    "release": Op({"lease": _int}),
    "heartbeat": Op(),
    "bye": Op(),
}
CONTROL_OPS = {"stats": Op(), "clear": Op(), "health": Op(), "flush_disk": Op(),
               "clear_disk": Op()}


class ProtocolError(ServerError):
    """A validation failure that still knows the request id (None if unreadable)."""

    def __init__(self, req_id, error: ServerError):
        super().__init__(str(error), code=error.code)
        self.req_id = req_id


@dataclass
class Request:
    id: int
    op: str
    fields: dict
    frames: list


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _refuse_ext(code, data):
    raise ValueError("msgpack ext types are not allowed")


def unpack_header(data: bytes):
    if len(data) > MAX_HEADER_BYTES:
        raise TooLarge(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True,
                               max_str_len=MAX_HEADER_BYTES, max_bin_len=MAX_HEADER_BYTES,
                               max_array_len=65536, max_map_len=64, max_ext_len=0,
                               ext_hook=_refuse_ext)
    except Exception as exc:  # msgpack raises many types for garbage input
        raise BadRequest(f"malformed msgpack header: {type(exc).__name__}") from None


def encode_request(req_id: int, op: str, fields: dict | None = None, frames=()) -> list:
    header = {"v": VERSION, "id": req_id, "op": op}
    header.update(fields or {})
    return [pack(header), *frames]


def parse_request(parts: list, ops: dict) -> Request:
    """Validate a request's frames against ``ops``; raise ProtocolError."""
    try:
        header = unpack_header(bytes(parts[0])) if parts else None
    except ServerError as exc:
        raise ProtocolError(None, exc) from None
    req_id = header.get("id") if isinstance(header, dict) and _int(header.get("id")) else None
    try:
        return _validate(header, parts[1:], ops)
    except ServerError as exc:
        raise ProtocolError(req_id, exc) from None


def _validate(header, frames: list, ops: dict) -> Request:
    if not isinstance(header, dict):
        raise BadRequest("header must be a msgpack map")
    _check_depth(header)
    if not _int(header.get("v")) or header.get("v") not in SUPPORTED_VERSIONS:
        raise VersionMismatch(f"protocol version {describe(header.get('v'))} not supported "
                              f"(supported: {list(SUPPORTED_VERSIONS)})")
    if not _int(header.get("id")):
        raise BadRequest("id must be a non-negative integer")
    op = header.get("op")
    spec = ops.get(op) if isinstance(op, str) else None
    if spec is None:
        raise UnknownOp(f"unknown op {describe(op)}")
    fields = {k: v for k, v in header.items() if k not in ("v", "id", "op")}
    for name in fields:
        if name not in spec.required and name not in spec.optional:
            raise BadRequest(f"{op}: unknown field {describe(name)}")
    for name, check in [*spec.required.items(), *spec.optional.items()]:
        if name not in fields:
            if name in spec.required:
                raise BadRequest(f"{op}: missing field {name!r}")
        elif not check(fields[name]):
            raise BadRequest(f"{op}: field {name!r} must be {_TYPE_NAMES[check]}")
    if len(frames) != spec.frames:
        raise BadRequest(f"{op}: expected {spec.frames} data frames, got {len(frames)}")
    return Request(header["id"], op, fields, [bytes(f) for f in frames])


def _check_depth(header: dict) -> None:
    """Refuse a header whose containers nest deeper than ``MAX_DEPTH``: no op needs it, and
    code that walks such a value recursively (``repr``, ``==``) would hit Python's
    recursion limit. Iterative, so the check itself cannot."""
    stack = [(header, 1)]
    while stack:
        node, depth = stack.pop()
        for item in node.values() if isinstance(node, dict) else node:
            if isinstance(item, (list, dict)):
                if depth >= MAX_DEPTH:
                    raise BadRequest(f"header nests containers deeper than {MAX_DEPTH} levels")
                stack.append((item, depth + 1))


def describe(value) -> str:
    """A peer's value as error messages and log lines may show it: bounded whatever the
    value (never its ``repr``, which recurses into nested containers and copies long
    strings whole). Scalars and short strings are shown (strings quoted and escaped,
    capped at ``DESCRIBE_CHARS``), a short list of scalars item by item, anything else
    by its type and size."""
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        bits = value.bit_length()
        return str(value) if bits <= 64 else f"an integer of {bits} bits"
    if isinstance(value, str):
        if len(value) <= DESCRIBE_CHARS:
            return repr(value)
        return f"{value[:DESCRIBE_CHARS]!r}... ({len(value)} characters)"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    if isinstance(value, list):
        if len(value) <= DESCRIBE_ITEMS and not any(isinstance(v, (list, dict)) for v in value):
            return f"[{', '.join(describe(v) for v in value)}]"
        return f"a list of {len(value)} item{'s' * (len(value) != 1)}"
    if isinstance(value, dict):
        return f"a map of {len(value)} entr{'ies' if len(value) != 1 else 'y'}"
    return f"a value of type {type(value).__name__}"


def ok_reply(req_id, result) -> list:
    return [pack({"v": VERSION, "id": req_id, "result": result})]


def error_reply(req_id, code: str, message: str) -> list:
    return [pack({"v": VERSION, "id": req_id, "error": {"code": code, "message": message}})]


def parse_reply(parts: list):
    """(id, result) of a reply; a typed error reply raises its ServerError."""
    header = unpack_header(bytes(parts[0]))
    if not isinstance(header, dict) or not _int(header.get("id")) and header.get("id") is not None:
        raise BadRequest("malformed reply")
    if "error" in header:
        err = header["error"] if isinstance(header["error"], dict) else {}
        code, message = err.get("code", "internal"), err.get("message", "")
        raise _with_id(server_error(code if isinstance(code, str) else "internal",
                                    message if isinstance(message, str) else describe(message)),
                       header.get("id"))
    return header.get("id"), header.get("result")


def _with_id(exc: ServerError, req_id):
    exc.req_id = req_id
    return exc


# ---- bulk arrays -------------------------------------------------------------

def keys_frame(keys: list) -> bytes:
    return b"".join(keys)


def keys_from_frame(data: bytes, max_keys: int) -> list:
    if len(data) % KEY_BYTES:
        raise BadRequest(f"keys frame length {len(data)} is not a multiple of {KEY_BYTES}")
    n = len(data) // KEY_BYTES
    if n > max_keys:
        raise TooLarge(f"{n} keys exceed the limit of {max_keys}")
    return [data[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)]


def pages_frame(page_ids) -> bytes:
    return np.ascontiguousarray(page_ids, dtype=PAGE_DTYPE).tobytes()


def pages_from_frame(data: bytes) -> np.ndarray:
    if len(data) % PAGE_DTYPE.itemsize:
        raise BadRequest("page id frame length is not a multiple of 8")
    return np.frombuffer(data, dtype=PAGE_DTYPE)


MAX_PART_CANDIDATES = 256  # partial keys one lookup may ask for (docs/protocol.md §8.5)


def part_tokens_from_wire(value, chunk_tokens: int, page_size: int | None) -> int:
    """A partial entry's tokens: fewer than a chunk's, a multiple of the registration's page
    size (None: an ``attach`` registration, which has none)."""
    if not _int(value) or not 0 < value < chunk_tokens or (page_size and value % page_size):
        step = f"a multiple of the page size {page_size} " if page_size else ""
        raise BadRequest(f"part_tokens must be {step}between 1 and {chunk_tokens - 1}, got {describe(value)}")
    return value


def part_candidates_from_wire(values, chunk_tokens: int, page_size: int | None, keys: int) -> list[int]:
    """A lookup's ``part_tokens``: one token count per partial key at the end of its keys
    frame (at most ``MAX_PART_CANDIDATES``, at most its keys)."""
    if not isinstance(values, list) or not 1 <= len(values) <= min(keys, MAX_PART_CANDIDATES):
        raise BadRequest(f"lookup: part_tokens must be a list of 1 to {MAX_PART_CANDIDATES} "
                         f"token counts, one per partial key at the end of the {keys} keys")
    return [part_tokens_from_wire(v, chunk_tokens, page_size) for v in values]


# ---- nested maps of register ------------------------------------------------

NAMESPACE_FIELDS = {"model": _str, "kv_dtype": _str, "attention": _str, "num_layers": _int,
                    "kv_heads": _int, "head_dim": _int, "tp_size": _int, "first_layer": _int,
                    "fingerprint": _str}
LAYOUT_FIELDS = {"num_layers": _int, "planes": _int, "num_pages": _int, "page_size": _int,
                 "row_bytes": _int, "page_stride": _int, "token_stride": _int, "bases": _list}
# Head-strided rows (kvd_protocol.layout): optional, absent means heads = 1. Sent only when
# heads > 1, so a layout with contiguous rows still registers with a daemon that predates them.
LAYOUT_OPTIONAL = {"heads": _int, "head_stride": _int}
BUFFER_FIELDS = {"shm": {"kind": _str, "path": _str, "size": _size},
                 "cuda_ipc": {"kind": _str, "handle": lambda v: isinstance(v, bytes) and len(v) == 64,
                              "offset": _size, "size": _size, "device_uuid": _str},
                 # virtual memory: the pieces' sizes, in address order; their file descriptors
                 # were lent through fds.sock (kvd_protocol.fd_pass) under ``token``
                 "cuda_vmm": {"kind": _str, "token": lambda v: isinstance(v, bytes) and len(v) == 16,
                              "pieces": lambda v: _list(v) and 1 <= len(v) <= MAX_FDS
                              and all(_size(p) and p > 0 for p in v),
                              "offset": _size, "size": _size, "device_uuid": _str}}


def _strict_map(m, schema: dict, what: str, optional: dict | None = None) -> dict:
    optional = optional or {}
    if not isinstance(m, dict) or not set(schema) <= set(m) <= set(schema) | set(optional):
        extra = f" (and optionally {sorted(optional)})" if optional else ""
        raise BadRequest(f"{what} must be a map with exactly the keys {sorted(schema)}{extra}")
    for name, check in {**schema, **optional}.items():
        if name in m and not check(m[name]):
            raise BadRequest(f"{what}.{name} must be {_TYPE_NAMES.get(check, 'valid')}")
    return m


def namespace_to_wire(ns: Namespace) -> dict:
    return {name: getattr(ns, name) for name in NAMESPACE_FIELDS}


def namespace_from_wire(m, chunk_tokens: int) -> Namespace:
    _strict_map(m, NAMESPACE_FIELDS, "namespace")
    try:
        return Namespace(chunk_tokens=chunk_tokens, **m)
    except ValueError as exc:
        raise BadRequest(f"namespace: {exc}") from None


def layout_to_wire(d: LayoutDescriptor) -> dict:
    wire = {name: getattr(d, name) for name in LAYOUT_FIELDS}
    wire["bases"] = [list(b) for b in d.bases]
    if d.heads != 1:
        wire.update(heads=d.heads, head_stride=d.head_stride)
    return wire


def layout_from_wire(m) -> LayoutDescriptor:
    _strict_map(m, LAYOUT_FIELDS, "layout", LAYOUT_OPTIONAL)
    bases = m["bases"]
    if len(bases) > 2 * MAX_LAYERS:
        raise BadRequest(f"layout.bases holds more than {2 * MAX_LAYERS} pairs")
    if not all(isinstance(b, list) and len(b) == 2 and _int(b[0]) and _int(b[1]) for b in bases):
        raise BadRequest("layout.bases must be a list of [buffer, offset] pairs")
    try:
        return LayoutDescriptor(**{**m, "bases": tuple((b[0], b[1]) for b in bases)})
    except ValueError as exc:
        raise BadRequest(f"layout: {exc}") from None


FLAGS_FIELDS = {"path": _str, "size": _int, "slots": _int}


def flags_from_wire(m, num_layers: int) -> tuple[dict, FlagLayout]:
    """The register's flag page map and the layout its words follow."""
    _strict_map(m, FLAGS_FIELDS, "flags")
    try:
        layout = FlagLayout(num_layers, m["slots"])
    except ValueError as exc:
        raise BadRequest(f"flags: {exc}") from None
    if m["size"] != layout.size:
        raise BadRequest(f"flags.size must be {layout.size} for {num_layers} layers and "
                         f"{m['slots']} slots, got {m['size']}")
    return m, layout


def buffers_from_wire(items, max_buffers: int) -> list:
    if not isinstance(items, list) or not 1 <= len(items) <= max_buffers:
        raise BadRequest(f"buffers must be a list of 1 to {max_buffers} maps")
    for i, b in enumerate(items):
        kind = b.get("kind") if isinstance(b, dict) else None
        if kind not in BUFFER_FIELDS:
            raise BadRequest(f"buffers[{i}].kind must be one of {sorted(BUFFER_FIELDS)}")
        _strict_map(b, BUFFER_FIELDS[kind], f"buffers[{i}]")
    if sum(len(b.get("pieces", ())) for b in items) > MAX_FDS:
        raise BadRequest(f"a registration's buffers have at most {MAX_FDS} pieces")
    return items
