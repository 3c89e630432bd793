"""The payload checksum of a disk chunk file, computable on the CPU and the GPU.

Definition (docs/protocol.md §11): zero-pad to a multiple of ``PAD`` (4096), cut into
``SEGMENT_BYTES`` (64 KiB) segments, XXH3-64 each (seed 0); the digest is the XXH3-128 of
those values, little-endian, in order. Why segments: they are independent, so a GPU Direct
Storage read is verified on the GPU (kvd.cuda.digest) before a byte reaches an engine's
pages, and the CPU path stays one library call per 64 KiB.
"""

from __future__ import annotations

import numpy as np
import xxhash

PAD = 4096
SEGMENT_BYTES = 64 << 10


def padded_length(n: int) -> int:
    return -(-n // PAD) * PAD


def segment_count(n: int) -> int:
    """Segments of an ``n``-byte payload."""
    return -(-padded_length(n) // SEGMENT_BYTES)


def segment_digests(payload) -> np.ndarray:
    """XXH3-64 of every segment of ``payload`` zero-padded to ``PAD`` (uint64 array)."""
    mv = memoryview(payload).cast("B")
    n = mv.nbytes
    out = np.empty(segment_count(n), np.uint64)
    full = n // SEGMENT_BYTES
    for i in range(full):
        out[i] = xxhash.xxh3_64_intdigest(mv[i * SEGMENT_BYTES:(i + 1) * SEGMENT_BYTES])
    if full < len(out):  # a last, shorter segment, with the zero padding the file holds too
        tail = bytearray(padded_length(n) - full * SEGMENT_BYTES)
        tail[:n - full * SEGMENT_BYTES] = mv[full * SEGMENT_BYTES:]
        out[full] = xxhash.xxh3_64_intdigest(tail)
    return out


def combine(digests: np.ndarray) -> bytes:
    """The 16-byte payload digest from the segment digests."""
    return xxhash.xxh3_128_digest(np.ascontiguousarray(digests, dtype="<u8").tobytes())


def payload_digest(payload) -> bytes:
    return combine(segment_digests(payload))
