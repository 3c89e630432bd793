"""A registered pool on the client's side, and the small records the client keeps.

``KVRegistration`` holds what re-registering after a daemon restart needs
(the register request's fields), the pool, its flag page (kvd_client.flags),
the id the current daemon gave it (0: not registered with it; ``wire``: the
fields of its register request, a virtual-memory pool's descriptors lent anew), the load
slots' last transfers (a slot is reused once its last transfer is done,
i.e. fenced) and the mark and load sequence counters (uint32, never 0:
every flag word starts at 0). ``ChunkKeys`` marks precomputed keys passed
instead of token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvd_protocol import wire
from kvd_protocol.keys import Namespace
from kvd_protocol.runtime import fd_socket_path

from .flags import ClientFlags
from .transfer import Transfer


@dataclass(eq=False)
class KVRegistration:
    """A registered pool; ``id`` changes when the daemon restarts (0: not registered)."""

    namespace: Namespace
    tp_rank: int
    fields: dict
    pool: object
    flags: ClientFlags
    id: int = 0
    pages_per_chunk: int = 0
    owners: list = field(default_factory=list)  # load slot -> its last Transfer
    mark_seq: int = 0
    load_seq: int = 0
    last_load: Transfer | None = None

    def wire(self, runtime_dir, timeout: float) -> dict:
        """The register (or attach) request's fields; a virtual-memory pool's file
        descriptors are lent to the daemon anew each time (kvd_client.vmm_share)."""
        if not getattr(self.pool, "lends_fds", False):
            return self.fields
        return {**self.fields, "buffers": self.pool.lend_buffers(fd_socket_path(runtime_dir), timeout)}


class Call:
    """A blocking request's reply slot."""

    def __init__(self):
        self.result, self.error, self.done = None, None, False

    def resolve(self, result, error) -> None:
        self.result, self.error, self.done = result, error, True





def engine_stream(pool) -> int | None:
    """The engine's current CUDA stream for a CUDA pool, else None."""
    current = getattr(pool, "stream_ptr", None)
    return None if current is None else current()


def next_seq(seq: int) -> int:
    seq = (seq + 1) & 0xFFFFFFFF
    return seq or 1  # 0 is every word's initial value


class ChunkKeys(tuple):
    """Chunk keys the caller computed (``KvdClient.keys``, or ``kvd_protocol.keys``),
    passed where a lookup, store or load takes ``tokens``. Keys chain on the whole
    prefix, so ``ChunkKeys(keys[i:])`` names chunks ``i..`` alone: a load that skips
    chunks the engine holds already, page ids given for chunks ``i..`` only."""


def part_pages(reg: KVRegistration, part_tokens: int) -> int:
    """Page ids a partial entry of ``part_tokens`` takes (0: none asked for)."""
    return -(-part_tokens // reg.pool.descriptor.page_size) if part_tokens and reg.pool else 0


def page_frame(reg: KVRegistration, chunks: int, page_ids, tail_pages: int = 0) -> bytes:
    """The page-id frame of ``chunks`` whole chunks, or with ``tail_pages`` of the last
    chunk only its first pages (a ``ValueError`` naming what is missing when ``page_ids``
    are too few: ceil(tokens / page_size) per chunk)."""
    ppc = reg.pages_per_chunk or reg.namespace.chunk_tokens // reg.pool.descriptor.page_size
    if tail_pages and (chunks < 1 or not 0 < tail_pages < ppc):
        raise ValueError(f"tail_pages must be between 1 and {ppc - 1} and cut a chunk, "
                         f"got {tail_pages} for {chunks} chunks")
    need = chunks * ppc - (ppc - tail_pages if tail_pages else 0)
    pages = np.asarray(page_ids, dtype=np.int64)
    if pages.ndim != 1 or len(pages) < need:
        raise ValueError(f"{chunks} chunks of {reg.namespace.chunk_tokens} tokens need "
                         f"{need} page ids (ceil(tokens / page_size) per chunk), got {pages.size}")
    return wire.pages_frame(pages[:need])

