"""KvdRadixCache: SGLang 0.5.16's radix cache with kvd under its GPU pool (``--radix-cache-backend kvd``).

SGLang 0.5.16 has no linker; its narrowest hook into the GPU pool is a radix cache of one's
own (kvd_client.sglang.plugin registers this one): SGLang's ``RadixCache``, plus:
``match_prefix`` (for a request) looks up the page-aligned tokens past the GPU prefix in kvd,
pins the hit under a lease, reports it as a host hit; ``init_load_back`` allocates GPU slots and
has the daemon copy the pages straight into them (one copy, the copy engines, after the
scheduler stream's work), waited for before they join the tree; ``cache_finished_req`` stores
a request's full pages from the tree's slots, their node locked until the store ended. TP
ranks agree on each hit and load (their trees stay alike). Token keys, shared with vLLM and
the HiCache backend. Every failure is a miss or a skipped store, never an exception.
"""

from __future__ import annotations

import json
import logging
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from kvd_protocol.errors import KvdError
from kvd_protocol.wire import tenant_label

from ..registration import ChunkKeys
from . import device_pages
from .chain import request_salt
from .device_link import DeviceLink
from .options import Options
from .timeline import Timeline

log = logging.getLogger("kvd_client.sglang")
MEMO = 4096  # requests whose last lookup answer is remembered (a waiting request is matched often)


@dataclass
class Hit:
    """A lookup's answer for one request: what init_load_back loads, under which lease."""
    shape: tuple            # (GPU prefix tokens, page-aligned tokens): the match it answered
    key: RadixKey | None    # the hit's tokens (a snapshot), None for a miss
    device: int = 0         # tokens already in the GPU tree
    extra: int = 0          # tokens kvd adds after them (whole pages)
    lease: int | None = None
    salt: str | None = None


def radix_key(tokens: list[int], extra_key) -> RadixKey:
    return RadixKey(array("q", tokens), extra_key)  # SGLang 0.5.16's tree takes arrays


def options_of(server_args) -> Options:
    """The ``kvd_*`` keys of ``--hicache-storage-backend-extra-config`` (the backend's flag)."""
    raw = getattr(server_args, "hicache_storage_backend_extra_config", None) or "{}"
    extra = json.loads(raw) if isinstance(raw, str) else dict(raw)
    opts = Options.from_extra_config(extra)
    if opts.key_mode != "tokens":
        raise ValueError("kvd radix cache: keys are token keys; kvd_key_mode must be 'tokens'")
    return opts


class KvdRadixCache(RadixCache):
    pool_factory = staticmethod(device_pages.kvd_pool)  # the pool kvd registers

    def __init__(self, ctx):
        self.hits: OrderedDict[str, Hit] = OrderedDict()
        self.stores: deque = deque()  # (transfer, node locked for it), in submission order
        super().__init__(ctx.params)
        if (getattr(ctx.params, "pp_size", 1) or 1) > 1:  # stages' trees would need agreeing too
            raise ValueError("kvd radix cache: pipeline parallelism is not supported")
        self.options = opts = options_of(ctx.server_args)
        opts.apply_process_settings()
        self.kvcache = self.token_to_kv_pool_allocator.get_kvcache()
        self.link = DeviceLink(opts, self.kvcache, self.page_size, ctx.server_args, ctx.params,
                               "radix", self.pool_factory)
        self.client = self.link.client
        self.timeline = Timeline.from_env("radix")
        self.counters = {"lookups": 0, "hit_tokens": 0, "loaded_tokens": 0, "failed_loads": 0,
                         "stored_tokens": 0, "failed_stores": 0, "refused_slots": 0}
        if self.is_eagle:
            log.warning("kvd radix cache: EAGLE's bigram keys are not kvd's token keys; kvd "
                        "stays unused")
        self.link.session()

    # ---- lookups ------------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        base = super().match_prefix(params)
        req = params.req
        if req is None or self.disable or self.is_eagle:
            return base
        self._drain_stores()
        aligned = len(params.key) // self.page_size * self.page_size
        shape = (len(base.device_indices), aligned)
        hit = self.hits.get(req.rid)
        if hit is None or hit.shape != shape:
            hit = self._lookup(req.rid, params.key, shape)
        if not hit.extra:
            return base
        last = base.last_device_node
        return MatchResult(device_indices=base.device_indices, last_device_node=last,
                           last_host_node=last, best_match_node=last, host_hit_length=hit.extra)

    def _lookup(self, rid: str, key: RadixKey, shape: tuple) -> Hit:
        self._forget(rid)
        device, aligned = shape
        hit = Hit(shape, None)
        if aligned > device:  # the same on every TP rank: each looks up, then they agree
            t0 = time.monotonic()
            hit.salt = request_salt(self.options.salt, None, key.extra_key)
            tokens = list(key.raw_token_ids()[:aligned])
            found, lease = self._found(tokens, hit.salt)
            end = self.link.agree_min(found // self.page_size * self.page_size)
            if end > device:
                hit.key, hit.device, hit.extra, hit.lease = radix_key(tokens[:end], key.extra_key), \
                    device, end - device, lease
                self.counters["hit_tokens"] += hit.extra
            elif lease is not None:  # no hit SGLang can take: let the pinned chunks go
                self.client.release(lease, wait=False)
            self.timeline.record("lookup", t0, tokens=aligned, device=device, hit=hit.extra, rid=rid)
        self.hits[rid] = hit
        while len(self.hits) > MEMO:
            self._forget(next(iter(self.hits)))
        return hit

    def _found(self, tokens: list[int], salt) -> tuple[int, int | None]:
        """Tokens of kvd's hit for ``tokens`` (0 without a daemon), and its lease."""
        reg = self.link.session()
        if reg is None:
            return 0, None
        self.counters["lookups"] += 1
        try:
            return self.client.lookup_lease(tokens, int(self.options.timeout_s * 1000), salt, reg)
        except KvdError as exc:
            log.warning("kvd lookup failed, a miss: %s", exc)
            return 0, None

    def _forget(self, rid: str) -> None:
        hit = self.hits.pop(rid, None)
        if hit is not None:
            self._let_go(hit)

    # ---- loads --------------------------------------------------------------------------

    def init_load_back(self, params):
        last = params.best_match_node
        hit = self.hits.pop(params.req.rid, None) if params.req is not None else None
        none = torch.empty((0,), dtype=torch.int64, device=self.device)
        if hit is None or not hit.extra or hit.extra != params.host_hit_length:
            if hit is not None:
                self._let_go(hit)
            return none, last
        slots = self._load(hit, last)
        if slots is None:
            self.counters["failed_loads"] += 1
            return none, last
        return slots, self._link_node(hit, last, slots)

    def _load(self, hit: Hit, last: TreeNode):
        """GPU slots holding the hit's pages on every TP rank, or None (nothing held)."""
        t0, n = time.monotonic(), hit.extra
        child = hit.key[hit.device:hit.device + self.page_size].child_key(self.page_size)
        if child in last.children:  # the tree grew there meanwhile (every rank's alike): compute
            self._let_go(hit)
            return None
        if self.token_to_kv_pool_allocator.available_size() < n:
            self.evict(EvictParams(num_tokens=n))
        slots = self.token_to_kv_pool_allocator.alloc(n)
        landed = slots is not None and self._copy(hit, slots)
        landed = bool(self.link.agree_min(int(landed)))  # a rank that failed: all compute
        self.timeline.record("load", t0, tokens=n, landed=landed)
        if landed:
            self.counters["loaded_tokens"] += n
            return slots
        if slots is not None:
            self.token_to_kv_pool_allocator.free(slots)
        return None

    def _copy(self, hit: Hit, slots) -> bool:
        """The daemon copies the hit's pages into ``slots`` (after the scheduler stream's
        work on them) and this thread waits for it: True when every token landed."""
        reg, n = self.link.reg, hit.extra
        pages = None if reg is None else self.link.slots_to_pages(slots, n // self.page_size)
        if pages is None:
            self.counters["refused_slots"] += reg is not None
            self._let_go(hit)
            return False
        chunk = reg.namespace.chunk_tokens
        keys = self.client.keys(list(hit.key.raw_token_ids()), hit.salt, reg)
        want = ChunkKeys(keys[hit.device // chunk:(hit.device + n) // chunk])
        try:
            t = self.client.submit_load(want, pages, lease=hit.lease, reg=reg)
            t.wait()
            return t.ok and t.tokens >= n
        except KvdError as exc:
            log.warning("kvd load failed, SGLang computes: %s", exc)
            return False

    def _let_go(self, hit: Hit) -> None:
        if hit.lease is not None:
            self.client.release(hit.lease, wait=False)

    def _link_node(self, hit: Hit, last: TreeNode, slots) -> TreeNode:
        node = TreeNode(priority=last.priority)
        node.key = hit.key[hit.device:hit.device + hit.extra]
        node.value = slots
        node.parent = last
        last.children[node.key.child_key(self.page_size)] = node
        self.evictable_size_ += hit.extra
        self._update_leaf_status(last)
        self._update_leaf_status(node)
        self._record_store_event(node)
        return node

    # ---- stores -------------------------------------------------------------------------

    def cache_finished_req(self, req, is_insert: bool = True, **kwargs):
        self._forget(req.rid)
        super().cache_finished_req(req, is_insert=is_insert, **kwargs)
        self._drain_stores()
        reg = self.link.session()
        if not is_insert or self.disable or self.is_eagle or reg is None:
            return
        if self.link.mla and self.link.tp_rank != 0:  # rank 0 stores the latent all ranks hold
            return
        done = kwargs.get("kv_len_to_handle", len(req.origin_input_ids) + len(req.output_ids))
        tokens = (list(req.origin_input_ids) + list(req.output_ids))[:done]
        tokens = tokens[:len(tokens) // self.page_size * self.page_size]
        if not tokens:
            return
        # the tree's own slots: the request's duplicates were freed above
        held = RadixCache.match_prefix(self, MatchPrefixParams(key=radix_key(tokens, req.extra_key)))
        n = len(held.device_indices)
        pages = self.link.slots_to_pages(held.device_indices, n // self.page_size) if n else None
        if pages is None:
            return
        self.inc_lock_ref(held.last_device_node)
        try:
            t = self.client.submit_store(tokens[:n], pages, request_salt(self.options.salt, None,
                                         req.extra_key), reg, tenant=tenant_label(self.options.salt))
        except KvdError as exc:
            log.warning("kvd store not submitted: %s", exc)
            self.dec_lock_ref(held.last_device_node)
            return
        self.stores.append((t, held.last_device_node, n))

    def _drain_stores(self, wait: bool = False) -> None:
        """Unlock the nodes of stores that ended (all of them with ``wait``)."""
        if not self.stores:
            return
        self.client.poll()
        while self.stores and (wait or self.stores[0][0].done):
            t, node, n = self.stores.popleft()
            t.wait()
            ok = t.ok and t.tokens >= n
            self.counters["stored_tokens" if ok else "failed_stores"] += n if ok else 1
            self.dec_lock_ref(node)

    def evict(self, params):
        self._drain_stores()
        return super().evict(params)

    # ---- lifecycle ----------------------------------------------------------------------

    def reset(self):
        if hasattr(self, "link"):  # RadixCache.__init__ resets before this class's set-up
            self._drain_stores(wait=True)
            for rid in list(self.hits):
                self._forget(rid)
        super().reset()

    def close(self) -> None:
        self.reset()
        self.timeline.close()
        self.link.close()

    def kvd_stats(self) -> dict:
        self._drain_stores()  # an idle engine makes no other call that would
        return {**self.counters, "refused": self.link.refused, "registered": self.link.reg is not None}
