"""Listening to SGLang's page hashing, to learn the token ids behind each page hash.

``listen(recorder)`` replaces SGLang's ``get_native_hash`` (``get_hash_str`` where absent)
with a wrapper returning exactly what the original returns, then telling the recorder what
was hashed; ``unlisten`` restores it after the last recorder. ``ChainRecorder`` turns a call
into ``PageChain.record``, starting a chain at SGLang's namespace seed. Never records what
could map to another namespace's keys (0.5.16 pages with an ``extra_key``, bigram keys,
partial pages): those stay misses. The Rust radix-tree core hashes past this hook (the
backend warns).
"""

from __future__ import annotations

import logging
import threading

from sglang.srt.mem_cache import utils as sgl_utils

from .chain import PageChain, request_salt

log = logging.getLogger("kvd_client.sglang")
_lock = threading.Lock()
_recorders: list = []
_original = None
# whether SGLang's storage hashes start each request namespace's chain at its own seed (0.5.23)
NAMESPACED = hasattr(sgl_utils, "storage_namespace_seed")
# the hook: (name in sglang.srt.mem_cache.utils, whether it takes a prior digest, not a hex hash)
HOOK = ("get_native_hash", True) if hasattr(sgl_utils, "get_native_hash") else ("get_hash_str", False)


def listen(recorder) -> None:
    global _original
    with _lock:
        if _original is None:
            _original = getattr(sgl_utils, HOOK[0])
            setattr(sgl_utils, HOOK[0], _hashed)
        _recorders.append(recorder)


def unlisten(recorder) -> None:
    global _original
    with _lock:
        if recorder in _recorders:
            _recorders.remove(recorder)
        if not _recorders and _original is not None:
            setattr(sgl_utils, HOOK[0], _original)
            _original = None


def _hashed(token_ids, prior=None, page_size=None):
    result = _original(token_ids, prior, page_size)
    prior_hash = (prior.hex() if prior else None) if HOOK[1] else prior
    for recorder in _recorders:
        try:
            recorder(token_ids, prior_hash, page_size, result)
        except Exception:  # never let bookkeeping break SGLang's hashing
            log.exception("kvd: recording a page hash failed; those pages will miss")
    return result


class ChainRecorder:
    def __init__(self, chain: PageChain, fixed_salt: str = ""):
        self.chain, self.fixed_salt = chain, fixed_salt

    def __call__(self, key, prior_hash, page_size, result) -> None:
        if getattr(key, "is_bigram", False):
            return
        raw_of = getattr(key, "raw_token_ids", None)
        tokens = raw_of() if raw_of is not None else getattr(key, "token_ids", key)
        n = len(key)
        hashes = [result] if page_size is None else list(result)
        size = n if page_size is None else page_size
        pages = [tokens[i * size:(i + 1) * size] for i in range(len(hashes))]
        if not pages or len(pages[-1]) != size or (size and isinstance(pages[0][0], tuple)):
            return
        if not NAMESPACED and getattr(key, "extra_key", None) is not None:
            return  # 0.5.16: the hash does not tell this namespace from the plain one
        parent, salt = self._start(key, prior_hash)
        self.chain.record(parent, salt, hashes, pages)

    def _start(self, key, prior_hash) -> tuple[str | None, str | None]:
        """(parent hash, salt) of the call's first page; salt None: the parent's chain's."""
        extra_key, cache_salt = getattr(key, "extra_key", None), getattr(key, "cache_salt", None)
        if prior_hash is None:
            return None, request_salt(self.fixed_salt, None, None)
        if NAMESPACED and (extra_key is not None or cache_salt is not None) and \
                prior_hash == sgl_utils.storage_namespace_seed(extra_key, cache_salt):
            return None, request_salt(self.fixed_salt, cache_salt, extra_key)
        return prior_hash, None
