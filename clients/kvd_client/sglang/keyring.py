"""Keyring: an SGLang page hash to its kvd chunk keys, for the HiCache backend and the linker.

``key_mode`` 'tokens' (kvd_client.sglang.options): the keyring listens to
SGLang's Python page hashing (kvd_client.sglang.hashing) and remembers each
page's token ids and parent (kvd_client.sglang.chain), so a page's keys are
those any kvd client computes for the same token prefix; a page whose hash
it never saw (or forgot) has none, and neither do the pages after it.
'hashes': keys derived from SGLang's page hash and the fixed salt, shared by
SGLang engines only. ``close`` stops listening. Never guesses a key.
"""

from __future__ import annotations

import logging

from sglang.srt.environ import envs

from kvd_protocol.keys import namespace_digest

from . import hashing
from .chain import PageChain, hash_page_keys

log = logging.getLogger("kvd_client.sglang")


def native_radix_tree() -> str | None:
    """The setting that makes SGLang's radix tree hash nodes natively, if it is on: 0.5.23's
    ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` (default ``rust``), 0.5.16's
    ``SGLANG_EXPERIMENTAL_CPP_RADIX_TREE`` (default off)."""
    core = getattr(envs, "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", None)
    if core is not None:
        return None if core.get() == "python" else \
            f"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND={core.get()}: set it to python"
    cpp = getattr(envs, "SGLANG_EXPERIMENTAL_CPP_RADIX_TREE", None)
    return "SGLANG_EXPERIMENTAL_CPP_RADIX_TREE is on: unset it" if cpp is not None and cpp.get() else None


class Keyring:
    def __init__(self, options):
        self.salt = options.salt
        self.chain = PageChain(options.key_map_pages) if options.key_mode == "tokens" else None
        self._recorder = None
        if self.chain is None:
            return
        self._recorder = hashing.ChainRecorder(self.chain, options.salt)
        hashing.listen(self._recorder)
        native = native_radix_tree()
        if native:
            log.warning("kvd: key_mode 'tokens' learns token ids from SGLang's Python hashing; "
                        "the native radix tree hashes nodes out of sight, so their pages will "
                        "miss (%s), or use kvd_key_mode 'hashes' (shared by SGLang engines "
                        "only)", native)

    def page_keys(self, hashes, namespace, page_size: int) -> list[tuple[bytes, ...]]:
        """The keys of the leading pages of ``hashes`` that have keys, one tuple per page."""
        digest = namespace_digest(namespace)
        if self.chain is not None:
            return self.chain.page_keys(hashes, digest, namespace.chunk_tokens)
        return hash_page_keys(hashes, digest, page_size // namespace.chunk_tokens, self.salt)

    def stats(self) -> dict:
        if self.chain is None:
            return {}
        return {"key_map_pages": len(self.chain), "key_map_forgotten": self.chain.forgotten}

    def close(self) -> None:
        if self._recorder is not None:
            hashing.unlisten(self._recorder)
            self._recorder = None
