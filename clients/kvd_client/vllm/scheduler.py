"""The scheduler's half of the connector: lookups, load and store plans, frees.

``SchedulerSide`` runs in vLLM's engine core (no KV): it attaches kvd's namespace and keeps
per request its keys, blocks and what moved. ``matched`` answers tokens kvd adds past vLLM's
own hit, ending on a block (kvd_client.vllm.hits), leased, never blocking a step
(``lookup_wait_ms``; None: ask again); no daemon is a miss. Large hits load asynchronously;
layer-wise loads leave enough to compute that vLLM never replays a full CUDA graph over
them. ``allocated``, ``step``, ``finished``, ``update`` follow vLLM's calls. Groups:
kvd_client.vllm.groups; stores: .stores; partial entries (a request's tail): .tails.
Requests with images or prompt embeddings are neither looked up nor stored. No vLLM import.
"""

from __future__ import annotations

import logging
import time

from kvd_protocol.keys import chain_root, chunk_keys, namespace_digest

from . import hits, labels, states, tails
from .counters import Counters
from .groups import NULL_BLOCK, KVGroup
from .plan import LoadItem, StepPlan, StoreItem, WorkerReport
from .request import ReqState
from .stores import Stores
from .settings import Settings

log = logging.getLogger("vllm.kvd")  # under vLLM's logger: its format and level


class SchedulerSide(Stores):
    def __init__(self, client, reg, settings: Settings, block_size: int, loads: bool, stores: bool,
                 counters: Counters, layerwise_min_compute: int = 2, layerwise: bool = True,
                 groups: list[KVGroup] | None = None):
        """``reg``: the namespace's registration, or one per group of ``groups`` (default: one
        full-attention group, vLLM's group 0)."""
        self.regs = list(reg) if isinstance(reg, (list, tuple)) else [reg]
        self.groups = groups or [KVGroup(0, (), "FullAttentionSpec")]
        if len(self.groups) != len(self.regs):
            raise ValueError("kvd: one registration per KV cache group is needed")
        self.client, self.reg, self.s = client, self.regs[0], settings
        self.layerwise_min_compute, self.layerwise = layerwise_min_compute, layerwise
        self.block_size, self.loads, self.stores = block_size, loads, stores
        self.counters = counters
        self.partial = not any(g.state for g in self.groups)  # hits end on blocks (hits.py)
        self.partials = settings.partial_tails and tails.enabled(self.groups)  # tails.py
        self.reqs: dict[str, ReqState] = {}
        self.failed = labels.FailedKeys()
        self.finish_stores: list[StoreItem] = []
        self.wait_left = settings.lookup_wait_ms / 1e3  # this step's wait for lookup replies

    @property
    def chunk(self) -> int:
        return self.reg.namespace.chunk_tokens

    # ---- keys -------------------------------------------------------------------

    def _state(self, request) -> ReqState:
        st = self.reqs.get(request.request_id)
        if st is None:
            n = len(self.groups)
            st = ReqState(request, labels.salt(self.s, request), labels.tenant(self.s, request),
                          keys=[[] for _ in range(n)], blocks=[[] for _ in range(n)],
                          leases=[None] * n, stored=[0] * n)
            st.cacheable = not getattr(request, "mm_features", None) \
                and getattr(request, "prompt_embeds", None) is None
            self.reqs[request.request_id] = st
        return st

    def _keys(self, st: ReqState, chunks: int, g: int = 0) -> list[bytes]:
        """The first ``chunks`` keys of the request in group ``g`` (tokens only get appended)."""
        keys, c = st.keys[g], self.chunk
        have = len(keys)
        if chunks > have:
            prev = keys[-1] if keys else chain_root(namespace_digest(self.regs[g].namespace), st.salt)
            keys += chunk_keys(prev, list(st.request.all_token_ids[have * c:chunks * c]), c)
        return keys[:chunks]

    # ---- admission --------------------------------------------------------------

    def matched(self, request, local: int) -> tuple[int | None, bool]:
        st = self._state(request)
        st.local, st.hit, st.loads = local, local, []
        st.served = max(st.served, local)
        usable = self._usable(st, local)
        if not usable:
            self._forget(st)
            return 0, False
        found = self._found(st, usable)
        if found is None:
            return None, False  # vLLM skips the request this step and asks again later
        return self._offer(st, min(found, self._top(st)))

    def _top(self, st: ReqState) -> int:
        """The most tokens a hit may cover: one token left to compute, on a block (on a
        chunk with a state group: kvd_client.vllm.hits)."""
        partial = self.partial and self._daemon_partial()
        return hits.top(st.request.num_tokens, self.chunk, self.block_size, partial)

    def _daemon_partial(self) -> bool:
        """Whether the daemon takes partial loads and entries (its hello says so)."""
        return bool(self.client.limits.get("partial_chunks"))

    def _usable(self, st: ReqState, local: int) -> int:
        """Chunks worth looking up (0: none past the local hit)."""
        c, top = self.chunk, self._top(st)
        limit = hits.chunks(top, st.request.num_tokens, c)  # chunks with a key
        if not self.loads or not st.cacheable or min(limit * c, top) <= local or c % self.block_size:
            return 0
        usable = min(self.failed.before(self._keys(st, limit, g)) for g in range(len(self.groups)))
        return usable if min(usable * c, top) > local else 0

    def _found(self, st: ReqState, usable: int) -> int | None:
        """Tokens kvd holds of the first ``usable`` chunks; None while the lookup is out."""
        if st.lookups is not None and all(x.poll() for x in st.lookups) \
                and any(self._stale(x.answered_at) for x in st.lookups):
            self._cancel(st)  # answered too long ago: its lease may lapse before the load
        if st.lookups is None and not self._reusable(st, usable):
            self._release(st)
            self.counters.add(lookups=1, lookup_tokens=usable * self.chunk - st.local)
            st.asked, st.found_at = usable, None
            st.lookups, st.questions = states.submit(self.client, self.groups, self.regs, st.keys,
                                                     usable, st.local // self.chunk, self.s.lease_ms)
        if st.lookups is not None:
            if not all(self._wait(x) for x in st.lookups):
                return None
            # every group must hold its chunks (a state group: a state at the hit's end)
            st.found, st.leases, spare = states.combine([x.result() for x in st.lookups],
                                                        st.questions, self.groups, self.chunk)
            for lease in spare:
                self.client.release(lease, wait=False)
            st.found_at = min(x.answered_at or time.monotonic() for x in st.lookups)
            st.tiers = next(((getattr(x, "disk_hits", 0), getattr(x, "remote_hits", 0))
                             for x, (_, i) in zip(st.lookups, st.questions) if i is None), (0, 0))
            st.lookups = None
            st.tail = self._ask_tail(st, min(st.found, usable * self.chunk))
        if st.tail is not None and not st.tail.answered:  # the partial entry where it stops
            if not self._wait(st.tail.lookup):
                return None
            st.tail.read()
        return min(st.found, usable * self.chunk) + (st.tail.tokens if st.tail else 0)

    def _ask_tail(self, st: ReqState, found: int):
        """Ask for the partial entries of the chunk where a whole-chunk hit of ``found`` tokens
        stops (kvd_client.vllm.tails); None when there is nothing to ask."""
        top, c = self._top(st), self.chunk
        if not self.partials or found % c or found >= top or not self._daemon_partial():
            return None
        return tails.ask(self.client, self.reg, st.request.all_token_ids, self._prev(st, found // c),
                         found // c, c, self.block_size, top, self.failed, self.s.lease_ms)

    def _prev(self, st: ReqState, chunk: int) -> bytes:
        """The key chunk ``chunk``'s key chains on (the root for chunk 0)."""
        if chunk:
            return self._keys(st, chunk)[-1]
        return chain_root(namespace_digest(self.reg.namespace), st.salt)

    def _reusable(self, st: ReqState, usable: int) -> bool:
        """vLLM asks again (no blocks this step, a preemption): a recent answer for the same
        chunks stands while its lease is held (or it found nothing)."""
        return st.found_at is not None and st.asked == usable and not self._stale(st.found_at) \
            and (all(lease is not None for lease in st.leases) or st.found == 0)

    def _stale(self, when: float | None) -> bool:
        return when is not None and time.monotonic() - when > self.s.lease_ms / 2e3

    def _wait(self, lookup) -> bool:
        """Whether the lookup is done, waiting out what is left of this step's budget."""
        start = time.monotonic()
        done = lookup.wait(self.wait_left)
        self.wait_left = max(0.0, self.wait_left - (time.monotonic() - start))
        return done

    def _offer(self, st: ReqState, tokens: int) -> tuple[int, bool]:
        """What vLLM may load of a hit of ``tokens`` (layer-wise or asynchronously)."""
        local, c = st.local, self.chunk
        if tokens <= local:
            self._release(st)
            return 0, False
        short = st.request.num_tokens - tokens < self.layerwise_min_compute
        several = len(self.groups) > 1  # vLLM takes their failures per request: async only
        st.asynchronous = local % c == 0 and (tokens - local >= self.s.async_load_min_tokens
                                              or short or not self.layerwise or several)
        if st.asynchronous and not self._on_chunks(tokens) or several and not st.asynchronous:
            self._release(st)  # an async load cannot throw writes away (no block of this step)
            return 0, False
        if not st.asynchronous and short:  # its step must not be a pure-decode one (a full CUDA graph)
            granule = self.block_size if self.partial and self._daemon_partial() else c
            tokens = tails.fit(st.tail, hits.layerwise_end(st.request.num_tokens,
                                                            self.layerwise_min_compute, granule), c)
        if not st.asynchronous and (tokens <= local or not self.layerwise):
            self._release(st)
            return 0, False
        st.hit = tokens
        self.counters.add(hit_tokens=tokens - local)
        return tokens - local, st.asynchronous

    def _on_chunks(self, tokens: int) -> bool:
        """Whether every group's load of a hit of ``tokens`` starts on a chunk."""
        bpc = self.chunk // self.block_size
        return all(g.first_block(tokens, self.block_size) % bpc == 0 for g in self.groups)

    def allocated(self, request, blocks, external: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        if external <= 0:  # no load (vLLM declined the hit), or an async load that ended
            self._forget(st)
            return
        if st.hit - st.local != external:
            log.warning("kvd: vLLM allocated %d external tokens for %s, kvd offered %d; not loading",
                        external, request.request_id, st.hit - st.local)
            return
        all_ids, c, rid = blocks.get_block_ids(), self.chunk, request.request_id
        part = st.tail.tokens if st.tail is not None else 0  # a partial entry ends the hit
        last, loads = -(-(st.hit - part) // c), []  # the chunks the hit reaches into
        tail, tokens = hits.tail(st.hit - part, c, self.block_size), st.hit - st.local // c * c
        for g, group in enumerate(self.groups):
            ids, keys = list(all_ids[group.gid]), self._keys(st, last, g)
            if group.state:  # the state after the hit, into the request's state block
                item = states.load_item(rid, keys, ids, last, g, tokens)
            else:  # from the first block past the local hit, and in the window
                where = group.load_pages(ids, st.local, st.hit, self.block_size, c)
                item = where and LoadItem(rid, keys[where[0]:], where[1], where[2],
                                          not st.asynchronous, g, tokens, tail)
            if not item:
                log.warning("kvd: a null block in the hit of %s; not loading", rid)
                st.hit = st.local
                return
            loads.append(item)
        if part:
            loads = tails.split(loads[0], st.tail, c // self.block_size)
        st.loads, st.stored = loads, [max(n, last) for n in st.stored]
        st.served = max(st.served, st.hit)

    # ---- each step ----------------------------------------------------------------

    def step(self, so) -> StepPlan:
        self.wait_left = self.s.lookup_wait_ms / 1e3  # the next step's lookups
        plan = StepPlan(b"".join(namespace_digest(r.namespace) for r in self.regs))
        for st in self.reqs.values():
            if st.loads:
                plan.loads += st.loads
                st.loading, st.loads = not st.loads[0].layerwise, []
        self._track_blocks(so)
        if self.stores and self.s.store_policy == "all":
            self._store_computed(so, plan)
        plan.stores += self.finish_stores
        self.finish_stores = []
        plan.preempted = sorted(getattr(so, "preempted_req_ids", None) or ())
        return plan

    def _track_blocks(self, so) -> None:
        for nr in so.scheduled_new_reqs:
            if nr.req_id in self.reqs:
                self.reqs[nr.req_id].blocks = [list(nr.block_ids[g.gid]) for g in self.groups]
        cr = so.scheduled_cached_reqs
        for i, req_id in enumerate(cr.req_ids):
            st, new = self.reqs.get(req_id), cr.new_block_ids[i]
            if st is None or new is None:
                continue
            # vLLM < 0.34 flags a resumed request here; 0.34 re-sends it among the new ones
            resumed = req_id in getattr(cr, "resumed_req_ids", ())
            st.blocks = [list(new[g.gid]) if resumed else st.blocks[k] + list(new[g.gid])
                         for k, g in enumerate(self.groups)]

    # ---- the end of a request, and the workers' news -------------------------------

    def finished(self, request, block_ids) -> bool:
        """True: keep the blocks until the workers report the request. ``block_ids``: per
        vLLM KV cache group (a tuple of lists), or group 0's list."""
        if not block_ids or not isinstance(block_ids[0], (list, tuple)):
            block_ids = (list(block_ids),)
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return False
        self._forget(st)
        prompt = request.num_prompt_tokens
        self.counters.add(requests=1, prompt_tokens=prompt, recomputed_tokens=max(0, prompt - st.served))
        if st.loading:
            return True  # the load lands in these blocks; finished_recving frees them
        if self.stores and self.s.store_policy == "finish" and self._worth_storing(st):
            computed = min(request.num_computed_tokens, request.num_tokens)
            bpc = self.chunk // self.block_size
            for g, group in enumerate(self.groups):
                ids = list(block_ids[group.gid])
                nulls = [i for i, b in enumerate(ids) if b == NULL_BLOCK]  # freed window blocks
                held = (nulls[-1] // bpc + 1) if nulls else 0
                item = self._state_item(st, g, computed, False, ids) if group.state else \
                    self._store_item(st, g, computed // self.chunk, ids, False, held)
                if item is not None:
                    self.finish_stores.append(item)
        if self.partials and self.stores and self.s.store_policy != "off" and st.cacheable \
                and self._daemon_partial():
            self._store_tail(st, request, list(block_ids[self.groups[0].gid]))
        return st.stores_sent

    def update(self, finished_recving, report: WorkerReport | None) -> None:
        for req_id in finished_recving or ():
            st = self.reqs.get(req_id)
            if st is not None:
                st.loading = False
                self._release(st)
        if report is None or not report.failed_keys:
            return
        self.failed.add(report.failed_keys, self.s.retry_failed_after_s)
        for st in self.reqs.values():  # those chunks are not in kvd: store them once recomputed
            for g, keys in enumerate(st.keys):
                bad = [i for i, key in enumerate(keys[:st.stored[g]]) if key in report.failed_keys]
                if bad:
                    st.stored[g] = bad[0]

    def _release(self, st: ReqState) -> None:
        if st.tail is not None:  # its lookup, its lease: as the chunks'
            st.tail.lookup.cancel()
            st.leases.append(st.tail.lease)
            st.tail = None
        for lease in st.leases:
            if lease is not None:  # never stalls a step; a lost release expires
                self.client.release(lease, wait=False)
        st.leases = [None] * len(self.groups)

    def _cancel(self, st: ReqState) -> None:
        for lookup in st.lookups or ():
            lookup.cancel()
        st.lookups = None

    def _forget(self, st: ReqState) -> None:
        """Drop the request's lookup state; a lease still to come is released on arrival."""
        self._cancel(st)
        st.found_at = None
        self._release(st)

    def close(self) -> None:
        for st in self.reqs.values():
            self._forget(st)
