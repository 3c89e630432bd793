"""vLLM 0.34's questions about the KV memory: how kvd reaches it, and when it is lent out.

``kv_cache_access(kv_transfer_config)`` answers vLLM's ``KVCacheAccess``: with
``kv_cache_sharing`` ``fd`` it is ``EXPORTS_FD`` (vLLM keeps its extensible,
virtual-memory KV cache, created exportable; the workers lend its allocations
to kvd by file descriptor: kvd_protocol.cuda_vmm, kvd_protocol.fd_pass); with
``legacy_ipc`` it is ``LEGACY_IPC`` (vLLM turns the extensible cache off and
allocates the KV cache where CUDA IPC exports it); ``auto`` (the default) is
``fd`` when the daemon of the configured runtime directory serves virtual
memory (its ``fds.sock`` exists: a daemon with GPUs that import file
descriptors), else ``legacy_ipc``. vLLM asks before any worker starts, in the
engine's process, so this is a file check, never a daemon call.

``may_load_async(settings, request, loads)`` is the cheap guess vLLM 0.34 asks
for when a request enters its waiting queue (with ``--max-num-inflight-kv-loads``
a yes lets its load start while the batch is full, and holds a load slot): yes
for a prompt longer than ``async_load_min_tokens`` (0: every prompt), the hits
the scheduler loads asynchronously (kvd_client.vllm.scheduler); shorter
prompts, whose hits mostly load layer by layer inside the step, get no and wait
in vLLM's ordinary queue, which is vLLM's default path and costs nothing.

``hit_sources(state, tokens, chunk)`` splits a hit vLLM 0.34 asks about by the
tier it comes from (``host``, ``disk``, ``p2p`` for kvd's remote tier: vLLM's
``CacheHitSource`` values). A lookup's hits run from chunk 0: the host tier's
prefix, then what continues it on disk, then in the remote store (the daemon's
reply says how many of each); the loaded tokens are ``[local, hit)`` of that.

``VERSIONS_TESTED`` names the vLLM releases the connector knows (engines
tested on 0.26 and 0.32, the API of 0.34), and
``version_note(version)`` is the one line logged when it meets another.
Imports vLLM only inside ``kv_cache_access`` (vLLM 0.34 has ``KVCacheAccess``).
"""

from __future__ import annotations

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
        return KVCacheAccess.EXPORTS_FD
    return KVCacheAccess.LEGACY_IPC


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
