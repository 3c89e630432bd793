"""The ``sglang.srt.plugins`` entry point of kvd-cache: ``--radix-cache-backend kvd``.

SGLang runs every general plugin installed in its environment in each of its processes,
before it builds the radix cache; ``register`` adds kvd's radix cache
(kvd_client.sglang.radix) to SGLang's registry under the name ``kvd``. It imports nothing of
kvd's until SGLang builds that cache, and does nothing on an SGLang without the registry;
building it on an SGLang with the external cache linker (>= 0.5.23) is a ``ValueError``.
``offer`` writes the entry point where kvd-cache is not installed (run from a checkout).
"""

from __future__ import annotations

NAME = "kvd"
ENTRY_POINT = "kvd_client.sglang.plugin:register"  # pyproject.toml's [project.entry-points]


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


def offer(folder, more: dict | None = None) -> str:
    """Where kvd-cache is not installed in SGLang's environment (run from a checkout): its
    entry point as an installed kvd-cache offers it (``more``: other ``name: module:function``
    plugins beside it), a dist-info written in ``folder``, which the caller puts first on the
    PYTHONPATH of SGLang's processes. Returns ``folder``."""
    import os

    info = os.path.join(folder, "kvd_cache-0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: kvd-cache\nVersion: 0.0\n")
    points = {NAME: ENTRY_POINT, **(more or {})}
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    return str(folder)
