"""Segment digests (kvd/tiers/disk/digest.py) of chunk payloads already in GPU memory.

``secret_tables()``: the XXH3 default secret as the 64-bit words
``kernels/xxh3_segments.cu`` reads (a CPU test replays the kernel on them).
``SegmentHasher(device)`` compiles the kernel once (CuPy imported lazily); ``digests(base,
stride, padded_len, n_chunks, stream)`` hashes ``n_chunks`` payloads at ``base + c *
stride`` and returns ``(n_chunks, segments)`` digests on the host after syncing ``stream``.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from kvd.cuda.kernels import kernel_source_path
from kvd.tiers.disk.digest import PAD, SEGMENT_BYTES, segment_count

KERNEL_FILE = "xxh3_segments.cu"
THREADS = 256
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")


def _word(offset: int) -> int:
    return struct.unpack_from("<Q", SECRET, offset)[0]


def secret_tables() -> np.ndarray:
    """152 words: stripe keys [16][8], scramble keys, last-stripe keys, merge keys."""
    words = [_word(8 * s + 8 * lane) for s in range(16) for lane in range(8)]
    words += [_word(len(SECRET) - 64 + 8 * lane) for lane in range(8)]       # scramble
    words += [_word(len(SECRET) - 64 - 7 + 8 * lane) for lane in range(8)]   # last stripe
    words += [_word(11 + 8 * lane) for lane in range(8)]                     # merge
    return np.array(words, dtype=np.uint64)


class SegmentHasher:
    def __init__(self, device: int) -> None:
        import cupy as cp
        self.cp = cp
        self.device = device
        with cp.cuda.Device(device):
            module = cp.RawModule(code=kernel_source_path(KERNEL_FILE).read_text(),
                                  options=("--std=c++14",))
            self._kernel = module.get_function("xxh3_segments")
            self._tables = cp.asarray(secret_tables())

    def digests(self, base: int, stride: int, padded_len: int, n_chunks: int, stream: Any) -> np.ndarray:
        if padded_len % PAD or padded_len <= 0 or base % 8 or stride % 8:
            raise ValueError("payloads must be 4096-multiples at 8-byte aligned addresses")
        cp = self.cp
        segs = segment_count(padded_len)
        total = segs * n_chunks
        with cp.cuda.Device(self.device):
            out = cp.empty(total, dtype=cp.uint64)
            grid = -(-total * 8 // THREADS)
            self._kernel((grid,), (THREADS,), (self._tables, np.uint64(base), np.uint64(stride),
                                               np.uint32(padded_len), np.uint32(SEGMENT_BYTES),
                                               np.uint32(segs), np.uint32(total), out),
                         stream=stream)
            host = out.get(stream=stream)  # synchronizes the stream
        return host.reshape(n_chunks, segs)
