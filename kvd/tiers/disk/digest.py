"""The payload checksum of a disk chunk file, computable on the CPU and the GPU.

Definition (file format 2, docs/protocol.md §11): zero-pad the payload to a
multiple of ``PAD`` (4096) bytes, cut it into ``SEGMENT_BYTES`` (64 KiB)
segments (the last one may be shorter, always a multiple of 4096), take the
XXH3-64 (seed 0) of every segment, and the digest is the XXH3-128 (seed 0)
of those 64-bit values written little-endian, in order.

Why segments: XXH3 of one long input is a sequential chain, so a GPU
cannot compute it fast; segment digests are independent, so a GPU Direct
Storage read can be verified on the GPU (kvd/cuda/digest.py, one group of
8 threads per segment) before a byte reaches an engine's pages, and the CPU
path stays one library call per 64 KiB. Every segment is at least 4096
bytes long, so the GPU needs only XXH3's long-input path.
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
