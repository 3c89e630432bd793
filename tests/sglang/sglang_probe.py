"""A probe into a running SGLang scheduler, for tests/sglang/gpu_server.py.

SGLang loads the storage backend with ``module_path: "sglang_probe"`` and
``class_name: "KvdHiCacheStorage"`` (with kvd's radix cache: SGLang's plugin
loader runs ``install``): this module re-exports kvd's backend unchanged, and
importing it (in the scheduler process) adds one method to SGLang's ``Scheduler``, which the engine reaches
through ``Engine.collective_rpc("kvd_probe", path=..., op=...)``:

- ``op="poison"``: every byte of the GPU KV pool and of the HiCache host pool
  set to the bf16 value in ``path + ".in"`` (``{"value": v}``);
- ``op="digests"``: for the token ids in ``path + ".in"`` (``{"tokens": [...]}``),
  the GPU slots the radix tree holds for them (``match_prefix``) and the
  SHA-256 of each page over every layer's K and V rows;
- ``op="stats"``: the kvd backend's counters (``kvd_stats()``);
- ``op="detach"``: SGLang detaches its storage backend (its threads stop, the
  backend closes: its staging pool leaves /dev/shm), as before an engine's end.

The answer is written as JSON to ``path`` (RPC carries no return value).
"""

from __future__ import annotations

import hashlib
import json
from array import array

import torch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvd_client.sglang.backend import KvdHiCacheStorage  # noqa: F401 (the backend SGLang loads)


def _kv_pool(scheduler):
    return scheduler.token_to_kv_pool_allocator.get_kvcache()


def _poison(scheduler, value: float) -> dict:
    pool = _kv_pool(scheduler)
    for buf in [*pool.k_buffer, *pool.v_buffer]:
        buf.fill_(value)
    controller = getattr(scheduler.tree_cache, "cache_controller", None)  # none: kvd's radix cache
    host = controller.mem_pool_host if controller is not None else None
    if host is not None:
        host.kv_buffer.fill_(value)
    torch.cuda.synchronize()
    return {"layers": len(pool.k_buffer), "host_bytes": host.kv_buffer.nbytes if host is not None else 0}


def _match_params(key):
    try:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    except ImportError:  # an SGLang whose match_prefix takes the key itself
        return {"key": key}
    return {"params": MatchPrefixParams(key=key)}


def _token_ids(tokens: list[int]):
    """What this SGLang's RadixKey holds: 0.5.16 an ``array("q")`` (its radix tree refuses a
    list), newer ones a list."""
    wants = str(RadixKey.__init__.__annotations__.get("token_ids", ""))
    return array("q", tokens) if wants.startswith("array") else list(tokens)


def _digests(scheduler, tokens: list[int]) -> dict:
    tree = scheduler.tree_cache
    match = tree.match_prefix(**_match_params(RadixKey(_token_ids(tokens))))
    slots = match.device_indices.to(torch.int64)
    pool, page = _kv_pool(scheduler), tree.page_size
    out = []
    for start in range(0, len(slots) - page + 1, page):
        idx = slots[start:start + page].to(pool.k_buffer[0].device)
        h = hashlib.sha256()
        for k, v in zip(pool.k_buffer, pool.v_buffer):
            h.update(k[idx].contiguous().view(torch.uint8).cpu().numpy().tobytes())
            h.update(v[idx].contiguous().view(torch.uint8).cpu().numpy().tobytes())
        out.append(h.hexdigest())
    return {"matched_tokens": len(slots), "digests": out}


def _stats(scheduler) -> dict:
    tree = scheduler.tree_cache
    if hasattr(tree, "kvd_stats"):  # kvd's radix cache
        return tree.kvd_stats()
    backend = tree.cache_controller.storage_backend
    return backend.kvd_stats() if backend is not None else {}


def _detach(scheduler) -> dict:
    tree = scheduler.tree_cache
    if hasattr(tree, "kvd_stats"):  # kvd's radix cache: its link to the daemon closes
        tree.close()
        return {"ok": True, "message": "kvd radix cache closed"}
    ok, message = tree.detach_storage_backend()
    return {"ok": ok, "message": message}


def kvd_probe(self, path: str, op: str) -> None:
    args = {}
    if op in ("poison", "digests"):
        with open(path + ".in") as f:
            args = json.load(f)
    if op == "poison":
        result = _poison(self, args["value"])
    elif op == "digests":
        result = _digests(self, args["tokens"])
    elif op == "stats":
        result = _stats(self)
    elif op == "detach":
        result = _detach(self)
    else:
        raise ValueError(f"unknown probe op {op!r}")
    with open(path, "w") as f:
        json.dump(result, f)


def install() -> None:
    """The ``sglang.srt.plugins`` entry point gpu_server.py offers with kvd's radix cache, which
    loads no backend module: importing this module added the method."""


Scheduler.kvd_probe = kvd_probe
