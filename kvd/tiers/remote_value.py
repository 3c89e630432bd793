"""One chunk as a remote store holds it: the disk file's header, then the payload.

Value: the chunk file header of kvd/tiers/chunk_file.py (``HEADER.size``
bytes: magic, format and canonical-bytes versions, namespace digest, key,
payload length, shards, shard bytes, the segmented payload digest of
kvd/tiers/digest.py and the xxh3-64 of those fields), then the payload's
``length`` bytes (no padding: a store is not a block device). The same
fields and the same checksums as a disk file, so a chunk verifies the same
wherever it came from (docs/protocol.md §11).

Name: ``<prefix>/<namespace digest hex>/<chunk key hex>``. ``prefix`` is the
``remote_prefix`` knob (one per cluster or tenant sharing a store); the
chunk key already chains the namespace digest and the salt
(kvd_protocol.keys), so two clusters, tenants or models never read each
other's chunks.

Contracts:
- ``pack`` copies the payload once into a new buffer the caller owns (the
  host slot may be reused as soon as it returns); it blocks (digest and
  copy of the whole payload): call it from a thread.
- ``parse`` checks the header (magic, versions, header digest, shard sizes)
  and that it names this namespace and key and the value's length; it raises
  ``ChunkCorrupt`` and reads no payload byte.
- ``copy_verified`` recomputes the payload digest, then copies the payload
  into ``dest``; ``ChunkCorrupt`` leaves ``dest`` untouched.
"""

from __future__ import annotations

import numpy as np

from kvd.tiers.chunk_file import HEADER, ChunkCorrupt, ChunkHeader, pack_header, unpack_header
from kvd.tiers.digest import payload_digest


def store_name(prefix: str, ns: bytes, key: bytes) -> str:
    return f"{prefix}/{ns.hex()}/{key.hex()}"


def pack(ns: bytes, key: bytes, payload, shards: int, shard_bytes: int) -> memoryview:
    """The value of one chunk (a view of a new buffer): header, then a copy of ``payload``."""
    src = np.frombuffer(memoryview(payload).cast("B"), np.uint8)
    out = bytearray(HEADER.size + src.nbytes)
    digest = payload_digest(src)
    out[:HEADER.size] = pack_header(ns, key, src.nbytes, shards, shard_bytes, digest)
    np.copyto(np.frombuffer(out, np.uint8, src.nbytes, HEADER.size), src)  # releases the GIL
    return memoryview(out)


def parse(value, ns: bytes, key: bytes) -> ChunkHeader:
    """The verified header of ``value`` (a chunk of ``ns``/``key``); payload unchecked."""
    view = memoryview(value).cast("B")
    head = unpack_header(view[:HEADER.size])
    if head.ns != ns or head.key != key:
        raise ChunkCorrupt("value names another chunk")
    if view.nbytes != HEADER.size + head.length:
        raise ChunkCorrupt(f"value is {view.nbytes} bytes, its header says "
                           f"{HEADER.size + head.length}")
    return head


def copy_verified(value, head: ChunkHeader, dest) -> None:
    """Check the payload digest of ``value`` (parsed as ``head``), then copy it into ``dest``."""
    payload = memoryview(value).cast("B")[HEADER.size:HEADER.size + head.length]
    if payload_digest(payload) != head.digest:
        raise ChunkCorrupt("payload checksum mismatch")
    out = np.frombuffer(memoryview(dest).cast("B"), np.uint8)
    if out.nbytes != head.length:
        raise ChunkCorrupt(f"payload is {head.length} bytes, the slot {out.nbytes}")
    np.copyto(out, np.frombuffer(payload, np.uint8))
