"""KvdLinker: kvd as SGLang's external cache linker (``UnifiedCacheLinker``, SGLang >= 0.5.23).

One per scheduler process; registers SGLang's GPU KV pool by CUDA IPC (device_pages): a hit
is one copy from kvd's host tier into SGLang's GPU pages, layer by layer. ``lookup`` pins
hits under a lease until the load takes them; a waiting request's repeated matches reuse its
answer while the lease has half its time left. ``load`` + ``start_layer_wise_loading`` submit
layer-wise loads ordered after the kernels that last used the slots (layer_wait);
``finish_layer_wise_loading`` reports success. ``offload`` queues a store (offloads: GPU slot
ids read without a device sync; MLA: rank 0 only; none with ``kvd_offload`` false). Keys are
the HiCache backend's, shared both ways. Failures are misses or False, never exceptions into
SGLang. Full KV only (SWA, Mamba: ``ValueError``). Launch flags: docs/sglang.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from kvd_protocol.errors import KvdError
from kvd_protocol.wire import tenant_label

from ..registration import ChunkKeys
from . import device_pages
from .device_link import DeviceLink
from .keyring import Keyring
from .layer_wait import KvdLayerCounter
from .offloads import Offloads
from .options import Options
from .timeline import Timeline

log = logging.getLogger("kvd_client.sglang")
MEMO = 4096  # requests whose last lookup answer is remembered


@dataclass
class Answer:
    """A lookup's answer for one request, reused while SGLang asks the same again."""
    shape: tuple    # (pages asked, first and last page hash): the uncached pages it answered
    at: float       # time.monotonic() of the lookup
    pages: int = 0  # hit pages, pinned under ``lease`` until a load takes them or it is released
    lease: int | None = None


class KvdLinker(UnifiedCacheLinker):
    pool_factory = staticmethod(device_pages.kvd_pool)  # the pool kvd registers

    def __init__(self, server_args, params, *, components, extra_config=None,
                 forward_stream=None):
        self.forward_stream = forward_stream
        self.options = opts = Options.from_extra_config(extra_config)
        opts.apply_process_settings()
        others = sorted(getattr(c, "name", str(c)) for c in components if getattr(c, "name", c) != "FULL")
        if others:
            raise ValueError(f"kvd linker: only the full KV component is supported, not {others}")
        self.page_size = params.page_size
        self.kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.pools = {PoolName.KV: self.kvcache}
        self.link = DeviceLink(opts, self.kvcache, self.page_size, server_args, params, "linker",
                               self.pool_factory)
        self.mla, self.tp_rank, self.client = self.link.mla, self.link.tp_rank, self.link.client
        self.keyring = Keyring(opts)
        self.timeline = Timeline.from_env("linker")
        self.layer_done_counter = KvdLayerCounter(self.client, self.kvcache.layer_num)
        self.pending_loads: dict[str, tuple] = {}  # rid -> (keys, kvd pages, tokens, lease)
        self.answers: OrderedDict[str, Answer] = OrderedDict()  # rid -> its last lookup's answer
        self.offloads = Offloads(self._submit_store, opts.timeout_s)  # in SGLang's order
        self.counters = {"lookups": 0, "reused_answers": 0, "hit_pages": 0, "loaded_batches": 0,
                         "failed_loads": 0, "stored_pages": 0, "failed_stores": 0, "refused_transfers": 0}
        self._session()

    # ---- set-up ----------------------------------------------------------------------

    @property
    def reg(self):
        return self.link.reg

    def _session(self):
        return self.link.session()

    def _keyed(self, kv, reg) -> ChunkKeys | None:
        """The chunk keys of every page of ``kv``, or None when a page has none."""
        keyed = self.keyring.page_keys(kv.keys, reg.namespace, self.page_size)
        if len(keyed) < len(kv.keys):
            return None
        return ChunkKeys(k for page in keyed for k in page)

    def _slots(self, kv, reg) -> list[int] | None:
        return self.link.slots_to_pages(kv.device_indices, len(kv.keys))

    def _on_forward_stream(self):
        """Where a transfer's stream mark goes: after the forward's kernels on its pages."""
        if self.forward_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.forward_stream)

    # ---- loads --------------------------------------------------------------------------

    def lookup(self, rid: str, transfers) -> list[int]:
        kv = _kv(transfers)
        reg = self._session()
        if reg is None or kv is None or not kv.keys:
            return []
        t0 = time.monotonic()
        shape = (len(kv.keys), kv.keys[0], kv.keys[-1])  # page hashes chain: these name the run
        known = self.answers.get(rid)
        if known is not None and known.shape == shape and t0 - known.at < self.options.timeout_s / 2:
            self.counters["reused_answers"] += 1
            return list(range(1, known.pages + 1))
        self._release(rid)  # an earlier lookup's of the same request
        answer = Answer(shape, t0)
        keyed = self.keyring.page_keys(kv.keys, reg.namespace, self.page_size)
        if keyed:
            self._lookup(answer, keyed, reg)
        self._remember(rid, answer)
        self.timeline.record("lookup", t0, pages=len(kv.keys), hit_pages=answer.pages, rid=rid)
        return list(range(1, answer.pages + 1))

    def _lookup(self, answer: Answer, keyed: list, reg) -> None:
        """Fill in ``answer``: the hit pages of ``keyed`` and the lease that pins them."""
        self.counters["lookups"] += 1
        hits, lease = self.client.lookup_lease(ChunkKeys(k for page in keyed for k in page),
                                               int(self.options.timeout_s * 1000), reg=reg)
        answer.pages = hits // self.page_size
        if lease is not None and answer.pages:
            answer.lease = lease
        elif lease is not None:  # less than a page: nothing SGLang can load
            self.client.release(lease, wait=False)
        self.counters["hit_pages"] += answer.pages

    def _remember(self, rid: str, answer: Answer) -> None:
        self.answers[rid] = answer
        self.answers.move_to_end(rid)
        while len(self.answers) > MEMO:
            self._release(next(iter(self.answers)))

    def load(self, rid: str, transfers) -> bool:
        kv = _kv(transfers)
        reg = self._session()
        if reg is None or kv is None or not kv.keys or rid in self.pending_loads:
            return False
        t0 = time.monotonic()
        keys, slots = self._keyed(kv, reg), self._slots(kv, reg)  # GPU slot ids: a device sync
        if keys is None or slots is None:
            self.counters["refused_transfers"] += 1
            self._release(rid)
            return False
        answer = self.answers.pop(rid, None)  # consumed: a later match of this request asks kvd again
        self.pending_loads[rid] = (keys, slots, len(kv.keys) * self.page_size,
                                   answer.lease if answer else None)
        self.timeline.record("queue_load", t0, pages=len(kv.keys), rid=rid)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        self._release(rid)
        queued = self.pending_loads.pop(rid, None)
        if queued is not None and queued[3] is not None:
            self.client.release(queued[3], wait=False)
        return queued is not None

    def _release(self, rid: str) -> None:
        """Forget ``rid``'s answer and let go of the lease its lookup took, if it holds one."""
        answer = self.answers.pop(rid, None)
        if answer is not None and answer.lease is not None:
            self.client.release(answer.lease, wait=False)

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        pending, self.pending_loads = self.pending_loads, {}
        t0, loads = time.monotonic(), []
        with self._on_forward_stream():
            for keys, slots, tokens, lease in pending.values():
                try:
                    loads.append((self.client.submit_load(keys, slots, lease=lease, reg=self.reg,
                                                          layerwise=True), tokens))
                except KvdError as exc:  # no load slot in time: this request recomputes
                    log.warning("kvd load not submitted, a miss: %s", exc)
                    loads.append((None, tokens))
        self.timeline.record("submit_loads", t0, requests=len(loads),
                             tokens=sum(t for _, t in loads))
        return self.layer_done_counter.add_batch(loads)

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        t0 = time.monotonic()
        landed = self.layer_done_counter.finish(counter_index)
        self.client.poll()  # drop finished transfers the client keeps for poll()
        self.counters["loaded_batches" if landed else "failed_loads"] += 1
        self.timeline.record("finish_loads", t0, index=counter_index, landed=landed)
        return landed

    # ---- offloads ----------------------------------------------------------------------------

    def offload(self, transfers, session_id=None) -> bool:
        kv = _kv(transfers)
        if not self.options.offload or kv is None or not kv.keys:
            return False
        reg = self._session()
        if reg is None:
            return False
        if self.mla and self.tp_rank != 0:  # rank 0 stores the latent every rank holds
            self.offloads.add_noop()
            return True
        t0 = time.monotonic()
        keys = self._keyed(kv, reg)
        on_gpu = getattr(kv.device_indices, "is_cuda", False)  # checked once read (Offloads)
        if keys is None or (not on_gpu and self._slots(kv, reg) is None):
            self.counters["refused_transfers"] += 1
            return False
        self.offloads.add(keys, kv.device_indices, len(kv.keys), len(kv.keys) * self.page_size)
        self.timeline.record("offload", t0, pages=len(kv.keys))
        return True

    def _submit_store(self, keys, slot_ids, pages: int):
        """The store of one offload once its slot ids are in host memory (Offloads)."""
        reg = self._session()
        slots = None if reg is None else self.link.slots_to_pages(slot_ids, pages)
        if slots is None:
            self.counters["refused_transfers"] += 1
            return None
        with self._on_forward_stream():
            return self.client.submit_store(keys, slots, reg=reg, tenant=tenant_label(self.options.salt))

    def num_completed_offloads(self) -> int:
        t0 = time.monotonic()
        self.client.poll()
        done = self.offloads.poll()
        if self.offloads.queue:  # SGLang asks on every scheduler step: idle steps leave no line
            self.timeline.record("poll_offloads", t0, queued=len(self.offloads.queue), done=done)
        return done

    def pop_completed_offload(self) -> bool:
        entry = self.offloads.pop()
        ok = entry.ok
        if not entry.noop:
            self.counters["stored_pages" if ok else "failed_stores"] += entry.pages if ok else 1
        return ok

    # ---- lifecycle ---------------------------------------------------------------------------

    def reset(self) -> None:
        for rid in list(self.pending_loads):
            self.cancel_queued_load(rid)
        for rid in list(self.answers):
            self._release(rid)
        self.layer_done_counter.reset()
        self.offloads.wait_all()
        self.client.poll()

    def close(self) -> None:
        self.reset()
        self.keyring.close()
        self.timeline.close()
        self.link.close()

    def kvd_stats(self) -> dict:
        return {**self.counters, "refused": self.link.refused, "registered": self.reg is not None}


def _kv(transfers):
    return next((t for t in transfers or () if t.name == PoolName.KV), None)
