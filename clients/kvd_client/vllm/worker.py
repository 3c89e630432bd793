"""The worker's half of the connector: kvd transfers in and out of vLLM's blocks.

``WorkerSide`` (one per TP rank) registers the rank's KV pool (one per KV cache group) and
carries out the scheduler's ``StepPlan``, every transfer non-blocking: ``start`` (loads,
stores of final KV), ``wait_layer`` (a layer's attention after its load), ``after_forward``
(stores of this step's KV, never on top of a failed load), ``finished`` (requests whose
transfers ended and are fenced), ``load_errors``/``report``. Stores of ``fenced`` groups
(sliding window, state) end before the next forward. A worker whose registrations differ
from the plan's namespace digests refuses to move anything. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging

from kvd_client.registration import ChunkKeys
from kvd_protocol.errors import KvdError
from kvd_protocol.keys import namespace_digest

from .counters import Counters
from .geometry import KVGeometry
from .plan import LoadItem, StepPlan, StoreItem, WorkerReport

log = logging.getLogger("vllm.kvd")  # under vLLM's logger: its format and level


class WorkerSide:
    def __init__(self, client, geometry, layer_names: list, tp_rank: int, counters: Counters,
                 fenced: frozenset = frozenset()):
        """``geometry`` and ``layer_names``: one group's, or a list per group; ``fenced``: the
        groups whose blocks vLLM frees while a request runs (sliding windows)."""
        several = isinstance(geometry, (list, tuple))
        self.geos = list(geometry) if several else [geometry]
        groups = layer_names if several else [layer_names]
        self.client, self.tp_rank, self.counters, self.fenced = client, tp_rank, counters, fenced
        self.layer_index = {name: (g, i) for g, names in enumerate(groups)
                            for i, name in enumerate(names)}
        self.regs: list = []
        self.token_bytes: list[int] = []  # per group: one token's KV in this rank's pool
        self.sync: list[tuple[LoadItem, object]] = []      # this step's layer-wise loads
        self.async_loads: dict[str, list[tuple[LoadItem, object]]] = {}
        self.failed_recving: set[str] = set()
        self.fence: list = []                               # stores of fenced groups
        self.open_stores: dict[str, list] = {}              # request -> stores not yet done
        self.finishing: set[str] = set()
        self.failed_sync: set[str] = set()
        self.errors: set[int] = set()
        self.failed_keys: set[bytes] = set()
        self._mismatch_told = False

    @property
    def geo(self) -> KVGeometry:
        return self.geos[0]

    @property
    def reg(self):
        return self.regs[0] if self.regs else None

    def register(self, pools) -> None:
        """One pool per group (or the one group's pool), in group order."""
        for geo, pool in zip(self.geos, pools if isinstance(pools, (list, tuple)) else [pools]):
            self.regs.append(self.client.register_kv(pool, model=geo.model, tp_size=geo.tp_size,
                                                     tp_rank=self.tp_rank,
                                                     fingerprint=geo.fingerprint))
            self.token_bytes.append(pool.descriptor.shard_bytes(1))

    @property
    def chunk(self) -> int:
        return self.reg.namespace.chunk_tokens

    def _usable(self, plan: StepPlan) -> bool:
        if self.reg is None:
            return False
        if plan.namespace == b"".join(namespace_digest(r.namespace) for r in self.regs):
            return True
        if not self._mismatch_told:
            self._mismatch_told = True
            log.error("kvd: this worker's namespace differs from the scheduler's (%s): no loads "
                      "or stores", self.reg.namespace)
        return False

    # ---- one step -------------------------------------------------------------------

    def start(self, plan: StepPlan) -> None:
        self.failed_sync.clear()
        self._end_fenced()
        usable = self._usable(plan)
        for item in plan.stores:
            if not item.after_forward:
                self._store(item, usable)
        for item in plan.loads:
            if not usable:
                self._failed_load(item, 0)
                continue
            try:
                t = self.client.submit_load(ChunkKeys(item.keys), item.pages,
                                            reg=self.regs[item.group], layerwise=item.layerwise,
                                            tail_pages=item.tail, part_tokens=item.part)
            except (KvdError, ValueError) as exc:  # no free load slot in time; a page count
                log.warning("kvd: load for %s not sent: %s", item.req_id, exc)
                self._failed_load(item, 0)
                continue
            if item.layerwise:
                self.sync.append((item, t))
            else:
                self.async_loads.setdefault(item.req_id, []).append((item, t))

    def wait_layer(self, layer_name: str) -> None:
        where = self.layer_index.get(layer_name)
        if where is None:
            return
        for item, t in self.sync:
            if item.group == where[0]:
                self.client.wait_for_layer(where[1], t)

    def after_forward(self, plan: StepPlan) -> None:
        self._end_sync_loads()
        usable = self._usable(plan)
        for item in plan.stores:
            if item.after_forward:
                self._store(item, usable and item.req_id not in self.failed_sync)

    def _end_sync_loads(self) -> None:
        for item, t in self.sync:
            t.wait()  # ends by its deadline; a failed load is fenced within fence_quiet_s
            if not self._check_load(item, t):
                self.failed_sync.add(item.req_id)
        self.sync = []

    def _check_load(self, item: LoadItem, t) -> bool:
        got = t.tokens if t.ok else 0  # a partial last chunk (item.tail): its blocks' tokens
        whole = item.complete(got, self.chunk, self.geo.block_size)
        loaded = len(item.keys) if whole else got // self.chunk
        if item.group == 0:  # a request's load counts once, as the tokens of its hit
            self.counters.add(loads=1, loaded_tokens=item.tokens if whole and item.tokens
                              else loaded * self.chunk)
        self.counters.add(loaded_bytes=got * self.token_bytes[item.group])
        if whole:
            return True
        if t.error is not None:
            log.warning("kvd: load for %s failed, vLLM recomputes: %s", item.req_id, t.error)
        self._failed_load(item, loaded)
        return False

    def _failed_load(self, item: LoadItem, loaded: int) -> None:
        self.counters.add(load_failures=1)
        if len(self.regs) > 1:  # vLLM maps no block ids of several groups back: the request
            self.failed_recving.add(item.req_id)
        else:
            self.errors |= item.real_pages(loaded, self.chunk // self.geo.block_size if loaded else 0)
        self.failed_keys |= set(item.keys[loaded:])

    def _store(self, item: StoreItem, ok: bool) -> None:
        stores = self.open_stores.setdefault(item.req_id, [])  # known, even if skipped
        if not ok:
            return
        try:
            t = self.client.submit_store(ChunkKeys(item.keys), item.pages,
                                         reg=self.regs[item.group], tenant=item.tenant,
                                         part_tokens=item.part)
            stores.append(t)
            if item.group in self.fenced:
                self.fence.append(t)
        except (KvdError, ValueError) as exc:  # e.g. page count of another chunk size
            log.warning("kvd: store for %s skipped: %s", item.req_id, exc)

    def _end_fenced(self) -> None:
        """Window blocks vLLM freed since the last step may be another request's in this one:
        the stores that read them end first."""
        for t in self.fence:
            t.wait()
        self.fence = []

    def preempted(self, plan: StepPlan) -> None:
        """Before every step's forward (vLLM's ``handle_preemptions``; ``start`` may come after
        it): fenced stores end, and blocks of preempted requests go to other requests now, so
        stores from them end first."""
        self._end_fenced()
        for req_id in plan.preempted:
            for t in self.open_stores.get(req_id, ()):
                t.wait()

    # ---- what vLLM collects after each step ----------------------------------------------

    def finished(self, finished_req_ids) -> tuple[set[str] | None, set[str] | None]:
        self.client.poll()  # drive replies; transfers are tracked here, not in its list
        for req_id, stores in self.open_stores.items():
            self._count_stores(stores)
        self.finishing |= set(finished_req_ids or ()) & set(self.open_stores)
        sending = {r for r in self.finishing if not self.open_stores[r]}
        for req_id in sending:
            del self.open_stores[req_id]
        self.finishing -= sending
        recving = set()
        for req_id, loads in list(self.async_loads.items()):
            if all(t.done for _, t in loads):  # every group's load of the request
                for item, t in loads:
                    self._check_load(item, t)
                recving.add(req_id)
                del self.async_loads[req_id]
        return sending or None, recving or None

    def take_failed_recving(self) -> set[str]:
        """Requests whose async load failed (several groups: vLLM recomputes them whole)."""
        failed, self.failed_recving = self.failed_recving, set()
        return failed

    def _count_stores(self, stores: list) -> None:
        for t in [t for t in stores if t.done]:
            stores.remove(t)
            if t.ok:
                group = next((g for g, r in enumerate(self.regs) if r is t.reg), 0)
                self.counters.add(stores=1, stored_tokens=t.tokens if group == 0 else 0,
                                  stored_bytes=len(t.keys) * self.chunk * self.token_bytes[group])
            else:
                self.counters.add(stores=1, store_failures=1)

    def load_errors(self) -> set[int]:
        self._end_sync_loads()  # when wait_for_save comes later (vLLM's deferred finalize)
        errors, self.errors = self.errors, set()
        return errors

    def report(self) -> WorkerReport | None:
        if not self.failed_keys:
            return None
        keys, self.failed_keys = self.failed_keys, set()
        return WorkerReport(keys)

    def release(self, timeout: float) -> None:
        """Let transfers in flight end (bounded), then drop the registrations (the daemon keeps
        its chunks; ``register`` brings the pools back)."""
        for t in [t for stores in self.open_stores.values() for t in stores] + \
                [t for _, t in self.sync] + [t for ts in self.async_loads.values() for _, t in ts]:
            t.wait(timeout)
        for reg in self.regs:
            self.client.unregister(reg)
        self.regs, self.token_bytes = [], []

    def close(self, timeout: float) -> None:
        """Let transfers in flight end (bounded), then leave kvd."""
        self.release(timeout)
        self.client.close()
