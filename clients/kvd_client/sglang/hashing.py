"""Listening to SGLang's page hashing, to learn the token ids behind each page hash.

SGLang's storage interface passes page hashes only. Every page hash SGLang
computes in Python goes through ``sglang.srt.mem_cache.utils.get_hash_str``
(token ids, prior hash, page size), looked up as a module global by
``get_storage_hash_str`` (prefetch queries) and ``compute_node_hash_values``
(the Python radix-tree core's node hashes). ``listen(recorder)`` replaces
that global with a wrapper that returns exactly what the original returns
and then tells the recorder what was hashed; ``unlisten`` restores it once
the last recorder left. The Rust radix-tree core (SGLang's default) hashes
nodes natively, past this function: the backend warns about it at start-up.

``ChainRecorder`` turns one hashing call into ``PageChain.record``: a call
whose prior hash is SGLang's namespace seed for the key's (extra_key,
cache_salt), or none, starts a chain with the matching kvd salt; any other
prior hash is the parent page. Bigram (EAGLE) keys and calls that hash a
partial page are not recorded: those pages stay misses.
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


def listen(recorder) -> None:
    global _original
    with _lock:
        if _original is None:
            _original = sgl_utils.get_hash_str
            sgl_utils.get_hash_str = _hashed
        _recorders.append(recorder)


def unlisten(recorder) -> None:
    global _original
    with _lock:
        if recorder in _recorders:
            _recorders.remove(recorder)
        if not _recorders and _original is not None:
            sgl_utils.get_hash_str = _original
            _original = None


def _hashed(token_ids, prior_hash=None, page_size=None):
    result = _original(token_ids, prior_hash, page_size=page_size)
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
        parent, salt = self._start(key, prior_hash)
        self.chain.record(parent, salt, hashes, pages)

    def _start(self, key, prior_hash) -> tuple[str | None, str | None]:
        extra_key, cache_salt = getattr(key, "extra_key", None), getattr(key, "cache_salt", None)
        if prior_hash is None:
            return None, request_salt(self.fixed_salt, None, None)
        if (extra_key is not None or cache_salt is not None) and \
                prior_hash == sgl_utils.storage_namespace_seed(extra_key, cache_salt):
            return None, request_salt(self.fixed_salt, cache_salt, extra_key)
        return prior_hash, None
