"""Partial chunks in the scheduler: a request's tail shorter than a chunk, kept when it ends
and found by a later request that shares it (docs/protocol.md §8.5).

``store_item``: when a request ends, its computed tokens past its last whole chunk, cut to
a block, go to kvd under a partial key (``kvd_protocol.keys.part_key``); so does its
prompt's own tail where the answer reached past the prompt's last block (the caller asks for
both). ``ask``: where a later request's whole-chunk hit stops at chunk ``j``, a second
lookup asks for ``j``'s partial keys of every usable block-aligned length, longest first;
``split`` loads the whole chunks and the partial entry found: a conversation's next turn
hits the previous turn's tail. One full-attention KV cache group only (``enabled``); a partial
hit a layer-wise cut shortens is dropped (``fit``). Failure is a miss. No vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvd_client.registration import ChunkKeys
from kvd_protocol.keys import part_key

from .groups import NULL_BLOCK, KVGroup
from .plan import LoadItem, StoreItem


@dataclass
class Tail:
    """A request's partial lookup of chunk ``chunk``, and its answer."""
    lookup: object
    chunk: int
    keys: dict            # tokens -> partial key
    tokens: int = 0       # the partial entry found (0: none, or not answered yet)
    lease: int | None = None
    answered: bool = False

    def read(self) -> None:
        """Take the answer (the lookup is done): the longest partial entry kvd holds."""
        self.tokens, self.lease = self.lookup.result()  # no chain keys: the partial's tokens
        self.answered = True


def enabled(groups: list[KVGroup]) -> bool:
    return len(groups) == 1 and not groups[0].window and not groups[0].state


def ask(client, reg, tokens, prev: bytes, chunk_index: int, chunk: int, block: int, top: int,
        failed, lease_ms: int) -> Tail | None:
    """The partial lookup of chunk ``chunk_index`` (whose predecessor's key is ``prev``): every
    block-aligned length up to ``top`` tokens of the request, longest first (None: none)."""
    start = chunk_index * chunk
    most = min(top - start, chunk - block) // block * block
    counts = list(range(most, 0, -block))
    keys = {n: part_key(prev, tokens[start:start + n]) for n in counts}
    counts = [n for n in counts if failed.before([keys[n]])]
    if not counts:
        return None
    lookup = client.submit_lookup(ChunkKeys([keys[n] for n in counts]), lease_ms, reg=reg,
                                  part_tokens=counts)
    return Tail(lookup, chunk_index, keys)


def fit(tail: Tail | None, tokens: int, chunk: int) -> int:
    """A hit cut to ``tokens`` that would end inside the partial entry ends before it."""
    if tail is not None and tail.tokens and tokens < tail.chunk * chunk + tail.tokens:
        tail.tokens = 0
        return min(tokens, tail.chunk * chunk)
    return tokens


def split(item: LoadItem, tail: Tail, bpc: int) -> list[LoadItem]:
    """The load of a hit ending in ``tail``'s partial entry (``item``: its chunks' keys up to
    the partial one, every page of the hit): the whole chunks' load, then the partial one's."""
    whole = len(item.keys) * bpc
    part = LoadItem(item.req_id, [tail.keys[tail.tokens]], item.pages[whole:],
                    0 if item.keys else item.scratch, item.layerwise, item.group, tail.tokens,
                    part=tail.tokens)
    if not item.keys:
        return [part]
    return [replace(item, pages=item.pages[:whole], tokens=item.tokens - tail.tokens), part]


def store_item(req_id: str, tokens, prev: bytes, computed: int, chunk: int, block: int,
               ids: list[int], tenant: str | None, group: int) -> StoreItem | None:
    """The partial entry of the tokens computed past the last whole chunk, cut to a block
    (None: none, or its blocks are gone)."""
    j = computed // chunk
    n = (computed - j * chunk) // block * block
    bpc = chunk // block
    pages = ids[j * bpc:j * bpc + n // block]
    if not n or len(pages) < n // block or NULL_BLOCK in pages:
        return None
    return StoreItem(req_id, [part_key(prev, tokens[j * chunk:j * chunk + n])], pages, False,
                     tenant, group, part=n)
