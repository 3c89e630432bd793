"""The ``sglang.srt.plugins`` entry point of kvd-cache: ``--radix-cache-backend kvd``.

SGLang runs every general plugin installed in its environment in each of its processes,
before it builds the radix cache; ``register`` adds kvd's radix cache
(kvd_client.sglang.radix) to SGLang's registry under the name ``kvd``. It imports nothing of
kvd's until SGLang builds that cache, and does nothing on an SGLang without the registry;
building it on an SGLang with the external cache linker (>= 0.5.23) is a ``ValueError``.
"""

from __future__ import annotations

NAME = "kvd"


def register() -> None:
    try:
        from sglang.srt.mem_cache import registry
    except ImportError:  # an SGLang older than the registry
        return
    if NAME not in registry.registered_radix_cache_backends():
        registry.register_radix_cache_backend(NAME, build)


def build(ctx):
    import importlib.util

    if importlib.util.find_spec("sglang.srt.mem_cache.unified_cache") is not None:
        raise ValueError("kvd's radix cache is written for SGLang 0.5.16; this SGLang has the "
                         "external cache linker: use kvd's (docs/sglang.md, the linker)")
    from .radix import KvdRadixCache

    return KvdRadixCache(ctx)
