"""The scheduler's stores: which chunks of a request go to kvd, and when (a mixin of
``SchedulerSide``, kvd_client.vllm.scheduler, whose state it reads and updates).

- ``_store_computed``: with ``store_policy = all``, the whole chunks each step
  computed (a sliding window's only while vLLM still holds their blocks; a state
  group's state where a step ended on a chunk end).
- ``_store_item`` / ``_state_item``: a group's chunks from the first not in kvd,
  or its state at a chunk end not yet stored.
- ``_store_tail``: when a request ends, the tokens it computed past its last
  whole chunk, cut to a block, as a partial entry (kvd_client.vllm.tails).
- ``_worth_storing``: token ids say it all, and the prompt is long enough.
"""

from __future__ import annotations

from . import states, tails
from .plan import StepPlan, StoreItem
from .request import ReqState


class Stores:
    def _store_computed(self, so, plan: StepPlan) -> None:
        computed = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        cr = so.scheduled_cached_reqs
        computed.update(zip(cr.req_ids, cr.num_computed_tokens))
        for req_id, before in computed.items():
            st = self.reqs.get(req_id)
            if st is None or not self._worth_storing(st):
                continue
            end = min(before + so.num_scheduled_tokens.get(req_id, 0), st.request.num_tokens)
            for g, group in enumerate(self.groups):  # a window's blocks vLLM freed are not kept
                held = group.held_chunk(before, self.block_size, self.chunk)
                item = self._state_item(st, g, end, True) if group.state else \
                    self._store_item(st, g, end // self.chunk, st.blocks[g], True, held)
                if item is not None:
                    plan.stores.append(item)

    def _worth_storing(self, st: ReqState) -> bool:
        return st.cacheable and st.request.num_prompt_tokens >= max(self.s.store_min_tokens, self.chunk)

    def _state_item(self, st: ReqState, g: int, end: int, after_forward: bool, blocks=None):
        """Group ``g``'s state after ``end`` tokens, at a chunk end not yet stored."""
        item = states.store_item(st.request.request_id, self._keys(st, end // self.chunk, g),
                                 st.blocks[g] if blocks is None else blocks, end, self.chunk,
                                 st.stored[g], after_forward, st.tenant, g)
        if item is not None:
            st.stored[g], st.stores_sent = end // self.chunk, True
        return item

    def _store_item(self, st: ReqState, g: int, upto: int, blocks: list[int], after_forward: bool,
                    held: int = 0):
        """Group ``g``'s chunks from the first not in kvd (and not before ``held``) to ``upto``."""
        bpc = self.chunk // self.block_size
        upto = min(upto, len(blocks) // bpc)
        start = max(st.stored[g], held)
        if upto <= start:
            return None
        item = StoreItem(st.request.request_id, self._keys(st, upto, g)[start:],
                         blocks[start * bpc:upto * bpc], after_forward, st.tenant, g)
        st.stored[g], st.stores_sent = upto, True
        return item

    def _store_tail(self, st: ReqState, request, ids: list[int]) -> None:
        """The tokens computed past the last whole chunk, as a partial entry (tails.py); and the
        prompt's own tail where the answer's first tokens made that one longer: a next turn whose
        history holds another answer (regenerated, edited, not the model's) still finds it."""
        computed = min(request.num_computed_tokens, request.num_tokens)
        prompt = min(request.num_prompt_tokens, computed)
        b = self.block_size
        for end in sorted({computed // b * b, prompt // b * b}, reverse=True):
            item = tails.store_item(request.request_id, request.all_token_ids,
                                    self._prev(st, end // self.chunk), end, self.chunk,
                                    self.block_size, ids, st.tenant, 0)
            if item is not None:
                self.finish_stores.append(item)
                st.stores_sent = True
