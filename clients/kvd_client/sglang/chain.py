"""From SGLang's page hashes to kvd chunk keys.

SGLang gives storage backends only page hashes; kvd's keys (kvd_protocol.keys) chain over
token ids so every engine computes the same key for a prefix. ``PageChain`` records each
page's parent and token ids and computes its kvd keys (``page_keys``), memoized per
(namespace, chunk size), forgetting LRU pages past ``capacity``. A page it does not know
gets no keys (a miss), never another page's keys. Thread-safe. ``hash_page_keys`` is the
other key mode; ``request_salt`` salts as kvd's vLLM connector does.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict

import numpy as np
import xxhash

from kvd_protocol.keys import chain_root, chunk_keys


class _Page:
    __slots__ = ("memo", "parent", "salt", "tokens")

    def __init__(self, parent: str | None, salt: str | None, tokens: bytes):
        self.parent, self.salt, self.tokens = parent, salt, tokens
        self.memo: tuple | None = None  # ((digest, chunk_tokens), keys)


class PageChain:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be at least 1 page")
        self.capacity = capacity
        self._pages: OrderedDict[str, _Page] = OrderedDict()
        self._lock = threading.Lock()
        self.recorded = 0
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._pages)

    def record(self, parent: str | None, salt: str | None, hashes, token_pages) -> None:
        """Pages hashed in a row: ``hashes[i]`` covers ``token_pages[i]`` (token ids);
        the first page's parent is ``parent`` (None: the chain starts there, with
        ``salt``), every later page's is the page before it."""
        with self._lock:
            for page_hash, tokens in zip(hashes, token_pages):
                raw = np.asarray(tokens, dtype=np.int64)
                if raw.size and (raw.min() < 0 or raw.max() >= 2**32):
                    return  # not kvd token ids: the page and its descendants stay unknown
                known = self._pages.get(page_hash)
                if known is None:
                    self._pages[page_hash] = _Page(parent, salt if parent is None else None,
                                                   raw.astype("<u4").tobytes())
                    self.recorded += 1
                else:
                    self._pages.move_to_end(page_hash)
                parent = page_hash
            while len(self._pages) > self.capacity:
                self._pages.popitem(last=False)
                self.forgotten += 1

    def page_keys(self, hashes, ns_digest: bytes, chunk_tokens: int) -> list[tuple[bytes, ...]]:
        """kvd keys of each of the leading ``hashes`` it can key (one tuple of
        ``page tokens / chunk_tokens`` keys per page), up to the first it cannot."""
        out = []
        with self._lock:
            for page_hash in hashes:
                keys = self._resolve(page_hash, (ns_digest, chunk_tokens))
                if keys is None:
                    break
                out.append(keys)
        return out

    def _resolve(self, page_hash: str, epoch: tuple) -> tuple[bytes, ...] | None:
        path, cur = [], page_hash
        while True:
            page = self._pages.get(cur)
            if page is None:
                return None
            if page.memo is not None and page.memo[0] == epoch:
                prev = page.memo[1][-1]
                break
            path.append(page)
            if page.parent is None:
                prev = chain_root(epoch[0], page.salt)
                break
            cur = page.parent
        chunk = epoch[1]
        for page in reversed(path):
            tokens = np.frombuffer(page.tokens, dtype="<u4")
            if tokens.size == 0 or tokens.size % chunk:
                return None  # not whole chunks: kvd cannot key this page
            keys = tuple(chunk_keys(prev, tokens, chunk))
            page.memo = (epoch, keys)
            prev = keys[-1]
        self._pages.move_to_end(page_hash)
        return self._pages[page_hash].memo[1]


def hash_page_keys(hashes, ns_digest: bytes, keys_per_page: int,
                   salt: str = "") -> list[tuple[bytes, ...]]:
    """key_mode 'hashes': ``xxh3_128(digest || "sglang-page" [|| "\\0salt" || u32le(len)
    || salt] || hash bytes || u32le(j))`` for chunk ``j`` of each page, up to the first
    hash that is not hex. The fixed salt (``kvd_salt``) is in every key when set."""
    head = ns_digest + b"sglang-page"
    if salt:
        raw_salt = salt.encode()
        head += b"\0salt" + struct.pack("<I", len(raw_salt)) + raw_salt
    out = []
    for page_hash in hashes:
        try:
            raw = bytes.fromhex(page_hash)
        except (TypeError, ValueError):
            break
        out.append(tuple(xxhash.xxh3_128_digest(head + raw + struct.pack("<I", j))
                         for j in range(keys_per_page)))
    return out


def request_salt(fixed: str, cache_salt: str | None, extra_key: str | None) -> str | None:
    """The salt of a request: the deployment's fixed salt, the request's cache_salt and
    SGLang's extra_key (a LoRA id, ...), joined as kvd's vLLM connector joins its parts."""
    parts = [fixed] if fixed else []
    if cache_salt:
        parts.append(f"request:{cache_salt}")
    if extra_key is not None:
        parts.append(f"extra_key:{extra_key}")
    return "\x1f".join(parts) or None
