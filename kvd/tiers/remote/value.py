"""One chunk as a remote store holds it: the disk file's header, then the payload.

Value: kvd.tiers.disk.chunk_file's header, with ``remote_secret`` a keyed BLAKE2b ``TAG_BYTES``
tag over header and payload, then the payload (docs/protocol.md §11a). Checksums catch
damage; only the tag stops forgery. Name: ``<prefix>[/<key id>]/<ns hex>/<key hex>``, so
clusters, tenants and secrets never read each other's values. ``pack`` copies the payload
once (blocking: call from a thread); ``parse`` checks the header against namespace, key and
length without reading the payload; ``copy_verified`` verifies then copies (``ChunkCorrupt``
leaves ``dest`` untouched); ``make_head``/``verify_in_place`` serve the zero-copy path.
"""

from __future__ import annotations

import hashlib
import hmac

import numpy as np

from kvd.tiers.disk.chunk_file import HEADER, ChunkCorrupt, ChunkHeader, pack_header, unpack_header
from kvd.tiers.disk.digest import payload_digest

TAG_BYTES = 32


class Seal:
    """The keyed tag of a cluster secret (any string; a long random one)."""

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("a seal needs a non-empty secret")
        # BLAKE2b keys are at most 64 bytes: derive one of 32 from a secret of any length
        self._key = hashlib.blake2b(secret.encode(), digest_size=32,
                                    person=b"kvd-remote-key").digest()
        self.key_id = hashlib.blake2b(self._key, digest_size=8, person=b"kvd-remote-id").hexdigest()

    def tag(self, header, payload) -> bytes:
        """BLAKE2b-256 keyed with the secret's key over ``header`` then ``payload``
        (hashlib releases the GIL while it hashes a large buffer)."""
        h = hashlib.blake2b(key=self._key, digest_size=TAG_BYTES, person=b"kvd-remote-tag")
        h.update(header)
        h.update(payload)
        return h.digest()


def tag_bytes(seal: Seal | None) -> int:
    return 0 if seal is None else TAG_BYTES


def store_prefix(prefix: str, seal: Seal | None) -> str:
    """The names' prefix: ``remote_prefix``, then the key id of a secret."""
    return prefix if seal is None else f"{prefix}/{seal.key_id}"


def store_name(prefix: str, ns: bytes, key: bytes) -> str:
    return f"{prefix}/{ns.hex()}/{key.hex()}"


def value_bytes(payload_bytes: int, seal: Seal | None = None) -> int:
    return HEADER.size + tag_bytes(seal) + payload_bytes


def head_bytes(seal: Seal | None = None) -> int:
    """Bytes of a value before its payload: the header, then the tag of a seal."""
    return HEADER.size + tag_bytes(seal)


def make_head(ns: bytes, key: bytes, payload, shards: int, shard_bytes: int,
              seal: Seal | None = None, digest_of=payload_digest) -> bytes:
    """Header (and tag) of the value of ``payload``, read where it lies; ``digest_of(payload)``
    gives its payload digest (kvd/tiers/remote/digest_pool.py computes it in another process)."""
    src = np.frombuffer(memoryview(payload).cast("B"), np.uint8)
    header = pack_header(ns, key, src.nbytes, shards, shard_bytes, digest_of(src))
    return header if seal is None else header + seal.tag(header, src)


def pack(ns: bytes, key: bytes, payload, shards: int, shard_bytes: int,
         seal: Seal | None = None, out: bytearray | None = None) -> memoryview:
    """The value of one chunk (a view of a new buffer, or of the first ``value_bytes`` of
    ``out``): header, tag (with a seal), then a copy of ``payload``."""
    src = np.frombuffer(memoryview(payload).cast("B"), np.uint8)
    start = head_bytes(seal)
    if out is None:
        out = bytearray(start + src.nbytes)
    elif len(out) < start + src.nbytes:
        raise ValueError(f"a {len(out)}-byte buffer cannot hold a {start + src.nbytes}-byte value")
    out[:start] = make_head(ns, key, src, shards, shard_bytes, seal)
    np.copyto(np.frombuffer(out, np.uint8, src.nbytes, start), src)  # releases the GIL
    return memoryview(out)[:start + src.nbytes]


def parse(value, ns: bytes, key: bytes, seal: Seal | None = None) -> ChunkHeader:
    """The verified header of ``value`` (a chunk of ``ns``/``key``); payload and tag
    unchecked."""
    view = memoryview(value).cast("B")
    return _check_head(view[:HEADER.size], ns, key, seal, view.nbytes)


def _check_head(header, ns: bytes, key: bytes, seal: Seal | None, nbytes: int) -> ChunkHeader:
    head = unpack_header(header)
    if head.ns != ns or head.key != key:
        raise ChunkCorrupt("value names another chunk")
    want = head_bytes(seal) + head.length
    if nbytes != want:
        raise ChunkCorrupt(f"value is {nbytes} bytes, its header says {want}"
                           + ("" if seal is None else " with a keyed tag"))
    return head


def _check_payload(head_view, head: ChunkHeader, payload, seal: Seal | None,
                   digest_of=payload_digest) -> None:
    if digest_of(payload) != head.digest:
        raise ChunkCorrupt("payload checksum mismatch")
    if seal is not None and not hmac.compare_digest(head_view[HEADER.size:],
                                                    seal.tag(head_view[:HEADER.size], payload)):
        raise ChunkCorrupt("keyed tag mismatch: not written by a node with this remote_secret")


def verify_in_place(head, ns: bytes, key: bytes, shards: int, shard_bytes: int, payload,
                    seal: Seal | None = None, digest_of=payload_digest) -> ChunkHeader:
    """Check a fetched value's ``head`` (``head_bytes``) against ``ns``/``key`` and the
    geometry, and its payload digest (``digest_of(payload)``; and tag) over ``payload``,
    where the payload landed."""
    view = memoryview(head).cast("B")
    body = memoryview(payload).cast("B")
    if view.nbytes != head_bytes(seal):
        raise ChunkCorrupt(f"a head of {view.nbytes} bytes, {head_bytes(seal)} expected")
    parsed = _check_head(view[:HEADER.size], ns, key, seal, view.nbytes + body.nbytes)
    if parsed.shards != shards or parsed.shard_bytes != shard_bytes:
        raise ChunkCorrupt(f"{parsed.shards} shards of {parsed.shard_bytes} bytes, this "
                           f"namespace has {shards} of {shard_bytes}")
    _check_payload(view, parsed, body, seal, digest_of)
    return parsed


def copy_verified(value, head: ChunkHeader, dest, seal: Seal | None = None) -> None:
    """Check the payload digest of ``value`` (parsed as ``head``) and, with a seal, its tag;
    then copy the payload into ``dest``."""
    view = memoryview(value).cast("B")
    start = head_bytes(seal)
    payload = view[start:start + head.length]
    _check_payload(view[:start], head, payload, seal)
    out = np.frombuffer(memoryview(dest).cast("B"), np.uint8)
    if out.nbytes != head.length:
        raise ChunkCorrupt(f"payload is {head.length} bytes, the slot {out.nbytes}")
    np.copyto(out, np.frombuffer(payload, np.uint8))
