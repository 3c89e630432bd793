"""An SGLang 0.5.16 process for the radix-cache tests (no GPU): kvd's ``KvdRadixCache``.

JSON commands on stdin, one JSON answer a line, as sglang_worker.py. SGLang's parts are real:
its device pool on ``device="cpu"``, paged allocator, ``ReqToTokenPool``, ``CacheInitParams``,
its plugin loader (``load_plugins`` finds kvd-cache's ``sglang.srt.plugins`` entry point) and
``create_tree_cache``, its ``Req`` (matched by ``init_next_round_input``) and ``PrefillAdder``
(which loads a host hit back through ``init_load_back``). Then the worker stands in for the
forward: slots for the rest written with bytes of the engine's own seed, ``req_to_token``
filled, ``cache_finished_req``. The one part that differs from a GPU: ``kvd-shm`` is
KvdRadixCache with the device pool moved into a kvd SharedKVPool (shm_pool.py); ``kvd`` is
the plain class (on the CPU: refused, with the reason in its stats). Pages travel as digests.
TP: one worker process per rank, in a gloo group (``tp_rank``, ``tp_size``, ``dist``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
import types
import warnings
from array import array

warnings.filterwarnings("ignore")

import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.registry import (TreeCacheBuildContext, create_tree_cache,
                                           register_radix_cache_backend)
from sglang.srt.runtime_context import get_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

from kvd_client.sglang import plugin
from kvd_client.sglang.radix import KvdRadixCache
from sglang_worker import serve  # this directory: the command loop the workers share
from shm_pool import shm_device_pool

def load_kvd_plugin() -> None:
    """SGLang's own plugin loader, finding kvd-cache's entry point as an installed kvd-cache
    offers it (kvd_client.sglang.plugin.offer; pyproject.toml names the same, test_radix.py
    checks)."""
    from sglang.srt.plugins import load_plugins

    site = plugin.offer(tempfile.mkdtemp(prefix="kvd-plugin-"))
    sys.path.insert(0, site)
    try:
        load_plugins()
    finally:
        sys.path.remove(site)
        shutil.rmtree(site)


def tp_group(rank: int, size: int, init_file: str):
    """A gloo group of the TP ranks (one worker process each), as SGLang's CPU TP group; the
    process joins the default group first, at its first TP engine."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                             world_size=size)
    return torch.distributed.new_group(list(range(size)))


class ShmRadixCache(KvdRadixCache):
    pool_factory = staticmethod(shm_device_pool)

    def close(self) -> None:
        super().close()
        if self.link.reg is not None:
            self.link.reg.pool.close()  # its /dev/shm file goes


class Engine:
    """One SGLang rank: its device pool, allocator, request slots and radix cache."""

    def __init__(self, extra, backend="kvd-shm", page_size=16, layers=3, heads=2, dim=8,
                 pages=64, seed=0, model="tiny", tp_rank=0, tp_size=1, dist=None, pp_size=1):
        size = pages * page_size
        group = tp_group(tp_rank, tp_size, dist) if tp_size > 1 else None
        self.dev = MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.bfloat16,
                                    head_num=heads, head_dim=dim, layer_num=layers, device="cpu",
                                    enable_memory_saver=False, start_layer=0, end_layer=layers)
        self.alloc = PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cpu", self.dev,
                                                 False)
        self.reqs = ReqToTokenPool(size=8, max_context_len=size, device="cpu",
                                   enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.reqs,
                                 token_to_kv_pool_allocator=self.alloc, page_size=page_size,
                                 tp_cache_group=group, pp_size=pp_size)
        server_args = types.SimpleNamespace(
            model_path=model, served_model_name=model, tp_size=tp_size, radix_cache_backend=backend,
            hicache_storage_backend_extra_config=json.dumps(extra), enable_streaming_session=False)
        self.tree = create_tree_cache(TreeCacheBuildContext(
            server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=False,
            effective_chunked_prefill_size=None, tp_worker=None, model_config=None,
            tp_size=tp_size, tp_rank=tp_rank, tp_group=group))
        self.page_size, self.seed, self.count = page_size, seed, 0

    def request(self, tokens: list[int]) -> dict:
        """One request through the cache as SGLang's scheduler admits it (its ``Req`` matched,
        its ``PrefillAdder`` loading a host hit back), computed, finished; its hits and pages."""
        self.match(tokens)
        return self.admit()

    def match(self, tokens: list[int]) -> dict:
        """The request matched (the GPU tree, then kvd), not admitted yet (``admit``)."""
        self.count += 1
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        params.normalize(None)
        req = Req(f"r{self.count}", "", array("q", tokens), params)
        req.init_next_round_input(self.tree)  # match_prefix with the request: GPU + kvd
        self.matched = (req, tokens, len(req.prefix_indices), req.host_hit_length)
        return {"device": self.matched[2], "kvd": self.matched[3]}

    def admit(self) -> dict:
        """The matched request admitted (a host hit loaded back), computed, finished."""
        req, tokens, device, kvd = self.matched
        adder = PrefillAdder(self.page_size, self.tree, self.alloc, ScheduleBatch(reqs=[]),
                             new_token_ratio=0.5, rem_input_tokens=1 << 20, rem_chunk_tokens=None)
        admitted = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        if admitted is not AddReqResult.CONTINUE:
            raise RuntimeError(f"SGLang did not admit the request: {admitted}")
        prefix = req.prefix_indices  # with what init_load_back loaded
        have = len(prefix)
        rest = -(-(len(tokens) - have) // self.page_size) * self.page_size
        fresh = self.alloc.alloc(rest) if rest else prefix[:0]
        self._compute(fresh, tokens[have:])
        self.reqs.alloc([req])  # sets req.req_pool_idx
        slots = torch.cat([prefix, fresh])[:len(tokens)]
        self.reqs.req_to_token[req.req_pool_idx, :len(tokens)] = slots.to(torch.int32)
        pages = self.page_digests(slots)
        self.tree.cache_finished_req(req, kv_len_to_handle=len(tokens))
        self.reqs.free(req)
        return {"device": device, "kvd": kvd, "loaded": have - device, "pages": pages}

    def _compute(self, slots: torch.Tensor, tokens: list[int]) -> None:
        """What a forward writes: bytes of this engine's seed and the tokens' positions."""
        if not len(slots):
            return
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + len(tokens) + tokens[0])
        for layer in range(self.dev.layer_num):
            for t in (self.dev.k_buffer[layer], self.dev.v_buffer[layer]):
                rows = t[slots].view(torch.uint8)
                t[slots] = torch.randint(0, 256, rows.shape, dtype=torch.uint8,
                                         generator=gen).view(t.dtype)

    def page_digests(self, slots: torch.Tensor) -> list[str]:
        out = []
        for start in range(0, len(slots) - self.page_size + 1, self.page_size):
            idx = slots[start:start + self.page_size].to(torch.int64)
            h = hashlib.sha256()
            for layer in range(self.dev.layer_num):
                h.update(self.dev.k_buffer[layer][idx].contiguous().view(torch.uint8).numpy())
                h.update(self.dev.v_buffer[layer][idx].contiguous().view(torch.uint8).numpy())
            out.append(h.hexdigest()[:16])
        return out


def run(engines, cmd):
    op = cmd.pop("op")
    if op == "engine":
        name = cmd.pop("name")
        engines[name] = Engine(**cmd)
        return type(engines[name].tree).__name__
    e = engines[cmd["name"]]
    if op == "request":
        return e.request(cmd["tokens"])
    if op == "match":
        return e.match(cmd["tokens"])
    if op == "admit":
        return e.admit()
    if op == "accounting":  # SGLang's idle check: every slot free, in the tree, or locked there
        return {"available": e.alloc.available_size(), "evictable": e.tree.evictable_size(),
                "protected": e.tree.protected_size(), "total": e.alloc.size}
    if op == "sizes":  # no drain first: a store in flight keeps its node locked (protected)
        return {"protected": e.tree.protected_size(), "evictable": e.tree.evictable_size()}
    if op == "drain":
        e.tree._drain_stores(wait=True)
        return e.tree.kvd_stats()
    if op == "stats":
        return e.tree.kvd_stats()
    if op == "close":
        e.tree.close()
        del engines[cmd["name"]]
        return True
    raise ValueError(f"unknown op {op!r}")


def publish_server_args() -> None:
    """SGLang's process-wide server args, which its request and admission code read: the
    defaults of each field (SGLang's launcher would also resolve a model and a GPU)."""
    args = object.__new__(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        setattr(args, f.name, factory() if factory else None if f.default is dataclasses.MISSING
                else f.default)
    args.model_path = "tiny"
    get_context().set_server_args(args)


def main():
    publish_server_args()
    load_kvd_plugin()
    register_radix_cache_backend("kvd-shm", ShmRadixCache)
    serve(run, lambda e: e.tree.close())


if __name__ == "__main__":
    main()
