"""The segmented payload digest, and the tables the GPU kernel hashes with.

``emulate_kernel`` replays ``kernels/xxh3_segments.cu`` lane by lane on the
words of ``kvd.cuda.digest.secret_tables()``; it must equal the xxhash
library's XXH3-64, so the GPU kernel's constants and arithmetic are checked
here without a GPU (tests/cuda/test_gpu_gds.py checks the kernel itself).
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvd.cuda.digest import secret_tables
from kvd.tiers.disk import digest as D

M64 = (1 << 64) - 1
PRIME32_1, PRIME64_1 = 0x9E3779B1, 0x9E3779B185EBCA87
INIT = [0xC2B2AE3D, PRIME64_1, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
        0x85EBCA77, 0x27D4EB2F165667C5, PRIME32_1]


def emulate_kernel(data: bytes) -> int:
    t = [int(x) for x in secret_tables()]
    words = np.frombuffer(data, "<u8")
    acc = list(INIT)

    def stripe(first_word: int, keys: list) -> None:
        d = [int(words[first_word + lane]) for lane in range(8)]
        for lane in range(8):
            keyed = d[lane] ^ keys[lane]
            acc[lane] = (acc[lane] + d[lane ^ 1] + (keyed & 0xFFFFFFFF) * (keyed >> 32)) & M64

    n = len(data)
    blocks = (n - 1) // 1024
    for b in range(blocks):
        for s in range(16):
            stripe(b * 128 + s * 8, t[s * 8:s * 8 + 8])
        for lane in range(8):
            a = acc[lane] ^ (acc[lane] >> 47) ^ t[128 + lane]
            acc[lane] = (a * PRIME32_1) & M64
    for s in range(((n - 1) - blocks * 1024) // 64):
        stripe(blocks * 128 + s * 8, t[s * 8:s * 8 + 8])
    stripe((n - 64) // 8, t[136:144])
    h = n * PRIME64_1
    for j in range(4):
        prod = (acc[2 * j] ^ t[144 + 2 * j]) * (acc[2 * j + 1] ^ t[145 + 2 * j])
        h += (prod & M64) ^ (prod >> 64)
    h &= M64
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & M64
    return h ^ (h >> 32)


@pytest.mark.parametrize("n", [4096, 8192, 12288, 65536])
def test_kernel_arithmetic_matches_xxhash(n):
    data = np.random.default_rng(n).bytes(n)
    assert emulate_kernel(data) == xxhash.xxh3_64_intdigest(data)


@pytest.mark.parametrize("n", [1, 100, 4095, 4096, 65536, 65537, 200_000, 3 * 65536])
def test_segments_cover_the_zero_padded_payload(n):
    data = np.random.default_rng(n).bytes(n)
    padded = data + bytes(D.padded_length(n) - n)
    want = [xxhash.xxh3_64_intdigest(padded[i:i + D.SEGMENT_BYTES])
            for i in range(0, len(padded), D.SEGMENT_BYTES)]
    got = D.segment_digests(data)
    assert got.tolist() == want and len(got) == D.segment_count(n)
    assert D.payload_digest(data) == xxhash.xxh3_128_digest(np.array(want, "<u8").tobytes())


def test_any_flip_changes_the_digest():
    data = bytearray(np.random.default_rng(3).bytes(70_000))
    base = D.payload_digest(data)
    for pos in (0, 4095, 65535, 65536, 69_999):
        data[pos] ^= 1
        assert D.payload_digest(data) != base
        data[pos] ^= 1
