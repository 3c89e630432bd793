"""Chunk keys: 128-bit, prefix-chained, identical in every process.

``namespace_digest(ns)``: xxh3-128 of everything that makes two KV tensors incompatible
(``Namespace``: model, dtype, layers from ``first_layer``, ``fingerprint``...). The chain root
is that digest, or with a salt ``xxh3_128(digest || b"salt" || utf8(salt))``; chunk ``i``'s key
is ``xxh3_128(key_{i-1} || tokens_i)`` (token ids as little-endian uint32), canonical 16-byte
big-endian. Only whole chunks are links of the chain; ``part_key`` names a chunk's first
tokens (a partial entry) under another seed, never equal to a chunk key. Spec and vectors:
docs/protocol.md, tests/protocol/test_keys.py.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvd_protocol.limits import (
    MAX_CHUNK_TOKENS,
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_NAME_BYTES,
    MAX_TP_SIZE,
)

KEY_BYTES = 16
PART_SEED = int.from_bytes(b"kvd-part", "little")  # the seed of partial chunks' keys
NAMESPACE_VERSION = 2  # 2: first_layer and fingerprint
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "int8": 1, "uint8": 1}
ATTENTIONS = ("mha", "mla", "opaque")
FIELD_CAPS = {"num_layers": MAX_LAYERS, "kv_heads": MAX_KV_HEADS, "head_dim": MAX_HEAD_DIM,
              "chunk_tokens": MAX_CHUNK_TOKENS, "tp_size": MAX_TP_SIZE}


@dataclass(frozen=True)
class Namespace:
    """What makes two KV chunks interchangeable. Never depends on GPU layout.

    ``kv_heads`` counts the heads of one tensor-parallel shard. For MLA the
    latent is identical on every rank, so ``kv_heads`` must be 1 and
    ``tp_size`` is encoded as 1: MLA engines of any TP size share chunks.
    ``first_layer`` is the model-wide index of the pool's first layer (a
    pipeline stage holds layers ``first_layer .. first_layer + num_layers - 1``;
    0 without pipeline parallelism). ``fingerprint`` identifies the weights
    beyond ``model`` (e.g. a hash of checkpoint id, revision and LoRA id);
    empty by default, compared as bytes, never interpreted.
    ``opaque`` pages (one plane) are whole engine pages whose inner order kvd
    does not know (vLLM's CPU attention): they move only whole, ``kv_heads x
    head_dim x dtype size`` is a page's bytes / page size, and ``model`` must
    name the page format, which the attention kind keeps apart from real rows.
    """

    model: str
    kv_dtype: str
    attention: str
    num_layers: int
    kv_heads: int
    head_dim: int
    chunk_tokens: int
    tp_size: int = 1
    first_layer: int = 0
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.model or len(self.model.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"model must be a non-empty string of at most {MAX_NAME_BYTES} bytes")
        if not isinstance(self.fingerprint, str) or len(self.fingerprint.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"fingerprint must be a string of at most {MAX_NAME_BYTES} bytes")
        if self.kv_dtype not in DTYPE_SIZES:
            raise ValueError(f"kv_dtype must be one of {sorted(DTYPE_SIZES)}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}")
        for name, cap in FIELD_CAPS.items():
            value = getattr(self, name)
            if not 1 <= value <= cap:
                raise ValueError(f"{name} must be between 1 and {cap} (kvd_protocol.limits)")
        if not 0 <= self.first_layer <= MAX_LAYERS - self.num_layers:
            raise ValueError(f"first_layer + num_layers must be at most {MAX_LAYERS}")
        if self.attention == "mla" and self.kv_heads != 1:
            raise ValueError("MLA namespaces have kv_heads == 1 (one latent vector per token)")

    @property
    def shards(self) -> int:
        """Shards that make one chunk entry: one per TP rank, one for MLA."""
        return 1 if self.attention == "mla" else self.tp_size

    @property
    def planes(self) -> int:
        return 2 if self.attention == "mha" else 1

    @property
    def row_bytes(self) -> int:
        return self.kv_heads * self.head_dim * DTYPE_SIZES[self.kv_dtype]

    def encode(self) -> bytes:
        tp = 1 if self.attention == "mla" else self.tp_size
        text = "\0".join((self.model, self.kv_dtype, self.attention)).encode()
        fingerprint = self.fingerprint.encode()
        return (b"kvd-ns\0" + struct.pack("<I", NAMESPACE_VERSION) + struct.pack("<I", len(text))
                + text + struct.pack("<6I", self.num_layers, self.kv_heads, self.head_dim,
                                     self.chunk_tokens, tp, self.first_layer)
                + struct.pack("<I", len(fingerprint)) + fingerprint)


def namespace_digest(ns: Namespace) -> bytes:
    return xxhash.xxh3_128_digest(ns.encode())


def chain_root(ns_digest: bytes, salt: str | None = None) -> bytes:
    if not salt:
        return ns_digest
    return xxhash.xxh3_128_digest(ns_digest + b"salt" + salt.encode())


def chunk_keys(root: bytes, tokens, chunk_tokens: int) -> list[bytes]:
    """Keys of every whole chunk of ``tokens`` (ints in [0, 2**32))."""
    ids = _token_ids(tokens)
    n = ids.size // chunk_tokens
    raw = ids[: n * chunk_tokens].astype("<u4").tobytes()
    step = chunk_tokens * 4
    keys, prev = [], root
    for i in range(n):
        prev = xxhash.xxh3_128_digest(prev + raw[i * step:(i + 1) * step])
        keys.append(prev)
    return keys


def part_key(prev: bytes, tokens) -> bytes:
    """The key of a partial chunk: its first ``len(tokens)`` tokens (1 to chunk_tokens - 1)
    after the chunk whose key is ``prev`` (the chain root for chunk 0). XXH3-128 under its
    own seed (``PART_SEED``): never a whole chunk's key, never a link of the chain."""
    ids = _token_ids(tokens)
    if not ids.size:
        raise ValueError("a partial chunk holds at least one token")
    return xxhash.xxh3_128_digest(prev + struct.pack("<I", ids.size) + ids.astype("<u4").tobytes(),
                                  seed=PART_SEED)


def _token_ids(tokens) -> np.ndarray:
    try:
        ids = np.asarray(tokens)
    except (OverflowError, ValueError):
        raise ValueError("token ids must lie in [0, 2**32)") from None
    if ids.ndim != 1:
        raise ValueError("tokens must be a 1-d sequence of token ids")
    if ids.size == 0:
        ids = ids.astype(np.int64)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("token ids must lie in [0, 2**32)")
    return ids
