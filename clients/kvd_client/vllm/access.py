"""vLLM 0.34's questions about the KV memory: how kvd reaches it, and when it is lent out.

``kv_cache_access(kv_transfer_config)``: ``EXPORTS_FD`` (``kv_cache_sharing`` ``fd``: the
extensible cache lent by file descriptor) or ``LEGACY_IPC``; ``auto`` picks ``fd`` when the
runtime dir has ``fds.sock`` (a file check, never a daemon call), and says so once in the
log, with what to set where the engine fixes its KV cache size. ``may_load_async``: yes for
prompts longer than ``async_load_min_tokens``. ``hit_sources`` splits a hit by tier (``host``,
``disk``, ``p2p``). ``VERSIONS_TESTED`` and ``version_note`` name the releases known.
Imports vLLM only inside ``kv_cache_access``.
"""

from __future__ import annotations

import logging

from kvd_protocol.runtime import fd_socket_path, resolve_runtime_dir

from .settings import Settings

VERSIONS_TESTED = ("0.26", "0.32", "0.34")


def sharing(settings: Settings) -> str:
    """``fd`` or ``legacy_ipc``: what ``kv_cache_sharing`` resolves to now."""
    if settings.kv_cache_sharing != "auto":
        return settings.kv_cache_sharing
    runtime_dir = resolve_runtime_dir(settings.runtime_dir or None)
    return "fd" if fd_socket_path(runtime_dir).exists() else "legacy_ipc"


def kv_cache_access(kv_transfer_config):
    from vllm.config.kv_transfer import KVCacheAccess

    settings = Settings.from_extra(kv_transfer_config.kv_connector_extra_config)
    if sharing(settings) == "fd":
        if settings.kv_cache_sharing == "auto":
            _say_once(FD_PICKED)
        return KVCacheAccess.EXPORTS_FD
    return KVCacheAccess.LEGACY_IPC


# vLLM's own refusal of a fixed KV cache size with this cache names another connector's option
FD_PICKED = ("kvd: kv_cache_sharing 'auto' picked 'fd' (the daemon serves fds.sock): vLLM's extensible "
             "KV cache, lent to kvd by file descriptor. It cannot have a fixed size: with "
             "--num-gpu-blocks-override or --kv-cache-memory-bytes set kv_cache_sharing to 'legacy_ipc'")
_said: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        logging.getLogger("vllm.kvd").info(line)


def may_load_async(settings: Settings, request, loads: bool) -> bool:
    if not loads:
        return False
    prompt = getattr(request, "num_prompt_tokens", None)
    return prompt is None or prompt > settings.async_load_min_tokens


def hit_sources(state, tokens: int, chunk: int) -> dict[str, int]:
    """``tokens`` (the request's hit past vLLM's own) by tier; all ``host`` when the
    scheduler's state does not account for them."""
    if state is None or not tokens or state.hit - state.local != tokens:
        return {"host": tokens} if tokens else {}
    disk, remote = state.tiers
    host_end = max(0, state.found // chunk - disk - remote) * chunk
    disk_end = host_end + disk * chunk
    spans = {"host": (0, host_end), "disk": (host_end, disk_end), "p2p": (disk_end, state.hit)}
    out = {name: max(0, min(hi, state.hit) - max(lo, state.local))
           for name, (lo, hi) in spans.items()}
    return {name: n for name, n in out.items() if n}


def version_note(version: str) -> str | None:
    """One line naming the tested releases when ``version`` is not one of them."""
    if ".".join(version.split(".")[:2]) in VERSIONS_TESTED:
        return None
    return (f"kvd: the connector knows vLLM {', '.join(VERSIONS_TESTED)} (docs/vllm.md says how "
            f"each was tested), not {version}; it may work")
