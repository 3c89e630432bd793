"""vLLM's KV cache groups as kvd namespaces, and which blocks of each a hit needs.

With vLLM's hybrid manager each group (full attention, sliding window, state) is a kvd
namespace of its own (``group_tag`` in the fingerprint; one full-attention group keeps the
plain namespace). Full attention: every chunk below a hit. Sliding window: only chunks from
``first_block(N)`` (vLLM's null blocks below); stores only while all blocks are still held
(``held_chunk``). State (Mamba, prefix caching off): one state per chunk end a step ended on
(kvd_client.vllm.states). A hit is the shortest every group holds, so a lost chunk shortens
the hit, never leaves wrong KV. Nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from . import layers

NULL_BLOCK = 0  # vLLM's null block: the first block its pool hands out, never a request's own
SLIDING = "SlidingWindowSpec"
STATE = "MambaSpec"


def is_state(spec) -> bool:
    return type(spec).__name__ == STATE


def state_kind(spec) -> str:
    """A state spec's layer kind: vLLM 0.32's ``mamba_type`` enum name (``MAMBA2``, ...)."""
    kind = getattr(spec, "mamba_type", "MAMBA2")
    return str(getattr(kind, "name", kind)).upper()


@dataclass(frozen=True)
class KVGroup:
    gid: int                # vLLM's KV cache group index
    names: tuple[str, ...]  # the target model's layers in the group
    kind: str               # the spec's class name
    window: int = 0         # sliding window, tokens (0: every block is kept)
    extra: int = 0          # extra_retained_tokens: kept below the window

    @property
    def state(self) -> bool:
        """A state group: one block per request holds the state after its last token."""
        return self.kind == STATE

    def first_block(self, tokens: int, block_size: int) -> int:
        """The first block vLLM keeps (and a hit of ``tokens`` needs) in this group."""
        if not self.window:
            return 0  # a state group's load fills its one block, whatever the hit
        return max(0, tokens - self.window + 1 - self.extra) // block_size

    def load_pages(self, ids: list[int], local: int, hit: int, block_size: int,
                   chunk: int) -> tuple[int, list[int], int] | None:
        """An attention group's load of a hit of ``hit`` tokens past a local hit of ``local``
        into the request's blocks ``ids``: ``(first chunk, pages, scratch pages)``; None when a
        page would be a null block. The scratch writes (the first chunk's blocks vLLM holds
        already) go to vLLM's null block, which no request reads: not to a block of this
        request, whose new KV vLLM may write before the layer's load is waited for (its
        attention backends update the cache in an op of their own, ahead of the attention op
        that waits)."""
        bpc, end = chunk // block_size, hit // block_size
        own = max(local // block_size, self.first_block(hit, block_size))  # past the local hit
        first = own // bpc
        scratch = own - first * bpc   # pages of the first chunk not to fill (kvd_client.vllm.plan)
        if NULL_BLOCK in ids[own:end]:
            return None
        return first, [NULL_BLOCK] * scratch + ids[own:end], scratch

    def held_chunk(self, tokens: int, block_size: int, chunk: int) -> int:
        """The first chunk whose blocks are all still held after ``tokens`` were computed."""
        bpc = chunk // block_size
        return -(-self.first_block(tokens, block_size) // bpc)


def kv_groups(vllm_config, kv_cache_config) -> list[KVGroup]:
    """The groups holding target layers: full attention first, then sliding windows, then
    states (kvd_client.vllm.support checked their kinds)."""
    out = []
    for gid, names in layers.target_groups(vllm_config, kv_cache_config):
        group = kv_cache_config.kv_cache_groups[gid]
        spec = layers.layer_specs(group, names)[names[0]]
        kind = type(spec).__name__
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind == SLIDING else 0
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0) if window else 0
        out.append(KVGroup(gid, tuple(names), kind, window, extra))
    return sorted(out, key=lambda g: (g.state, g.window > 0, g.gid))


def group_tag(group: KVGroup, count: int) -> str:
    """The group's part of its namespace's fingerprint: "" for the one full-attention group of
    a model (the namespace of engines without groups), else kind, window and layers."""
    if count == 1 and not group.window:
        return ""
    kind = f"swa{group.window}" + (f"+{group.extra}" if group.extra else "") if group.window \
        else "state" if group.state else "full"
    index = [layers.layer_index(n) for n in group.names]
    names = ",".join(str(i) if i is not None else n for i, n in zip(index, group.names))
    if len(names) > 160:  # the fingerprint holds 512 bytes: long layer lists go as a digest
        names = "sha256-" + hashlib.sha256(names.encode()).hexdigest()[:16]
    return f"group={kind}:{names}"


def joined_fingerprint(*parts: str) -> str:
    return " ".join(p for p in parts if p)
