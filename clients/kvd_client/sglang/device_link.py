"""DeviceLink: one SGLang scheduler process's GPU KV pool registered with kvd.

Shared by the linker (SGLang >= 0.5.23) and the radix cache (SGLang 0.5.16). Owns the
``KvdClient`` and the registration of SGLang's device pool (``pool_factory``: CUDA IPC,
kvd_client.sglang.device_pages), made on first need and tried again every second while
the daemon is away. A pool kvd cannot take (a chunk that does not divide SGLang's page,
a pool kvd refuses) is refused once, with the reason in ``refused``: kvd then stays
unused and SGLang computes. ``session()`` never raises. ``agree_min`` makes TP ranks agree
on a number (a hit's length, a load's success) where each rank's tree must stay the same.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from kvd_protocol.errors import KvdError

from ..client import KvdClient
from . import device_pages

log = logging.getLogger("kvd_client.sglang")
RETRY_S = 1.0  # how often a link without a daemon tries again


def tp_group(params):
    """The group of ranks that share one KV layout (SGLang's CPU group for it)."""
    return getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def tp_of(server_args, params) -> tuple[int, int]:
    """This rank's (index, size) in the group that shares one KV layout."""
    if distributed():
        group = tp_group(params)
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
    return 0, int(getattr(server_args, "tp_size", 1) or 1)


def model_of(options, server_args, who: str) -> str:
    model = options.model_id or getattr(server_args, "served_model_name", None) \
        or getattr(server_args, "model_path", "")
    if not model:
        raise ValueError(f"kvd {who}: SGLang gave no model name; set kvd_model_id")
    return model


class DeviceLink:
    def __init__(self, options, kvcache, page_size: int, server_args, params, who: str,
                 pool_factory=device_pages.kvd_pool):
        self.options, self.kvcache, self.page_size = options, kvcache, page_size
        self.pool_factory = pool_factory
        self.mla = device_pages.pool_kind(kvcache) == "sglang_mla"
        self.tp_rank, self.tp_size = tp_of(server_args, params)
        self.group = tp_group(params)
        self.model = model_of(options, server_args, who)
        self.client = KvdClient(options.runtime_dir or None, timeout=options.timeout_s,
                                name=f"sglang-{who}:tp{self.tp_rank}:{os.getpid()}").connect()
        self.reg, self.refused = None, None
        self._retry_at = 0.0

    def session(self):
        """The registration of SGLang's device pool, once the daemon answered; else None."""
        if self.reg is not None or self.refused:
            return self.reg
        now = time.monotonic()
        if now < self._retry_at:
            return None
        self._retry_at = now + RETRY_S
        try:
            chunk = self.client.chunk_tokens
        except KvdError as exc:
            log.info("kvd not reachable (%s); kvd misses until it is", exc)
            return None
        if self.page_size % chunk:
            self.refused = (f"kvd's chunk ({chunk} tokens) does not divide SGLang's page size "
                            f"({self.page_size})")
            log.error("%s; kvd stays unused", self.refused)
            return None
        try:
            pool = self.pool_factory(self.kvcache, chunk)
            if self.options.kv_dtype:
                pool.kv_dtype = self.options.kv_dtype
            self.reg = self.client.register_kv(
                pool, self.model, tp_size=1 if self.mla else self.tp_size, tp_rank=self.tp_rank,
                first_layer=getattr(self.kvcache, "start_layer", 0) or 0,
                fingerprint=self.options.fingerprint)
        except (KvdError, ValueError, OSError) as exc:
            self.refused = f"kvd refused SGLang's device pool: {exc}"
            log.error("%s; kvd stays unused", self.refused)
        return self.reg

    def slots_to_pages(self, device_indices, pages: int) -> list[int] | None:
        """kvd page ids of ``pages`` SGLang pages at ``device_indices`` (None: not page-aligned)."""
        return device_pages.page_ids(device_indices, pages, self.page_size,
                                     self.reg.namespace.chunk_tokens)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` of every TP rank (each rank must call it at the same point);
        ``value`` itself with one rank."""
        if self.tp_size <= 1 or not distributed():
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def close(self) -> None:
        self.client.close()
