"""The flag page: completion signals either side can raise, so no death hangs the other.

Every registration has one small shared-memory file, created by the client
(``kvd-flags-<pid>-<hex>`` in the daemon's ``shm_dir``) and mapped by both
sides; on a CUDA pool both sides also register it with the driver
(host-mapped, portable), so GPU streams can write and wait on its words
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32``) and CPUs can read and
write them. Words are little-endian uint32; sequence numbers compare
cyclically (``reached``), as CUDA's GEQ wait does, so they may wrap.

Layout (word indices; ``FlagLayout`` computes them):

- ``MAGIC``, ``VERSION``, ``num_layers``, ``slots`` at words 0-3 (written by
  the client at creation; the daemon checks them).
- word ``MARK_WORD``: the engine's **mark**. Before each store or load the
  engine's stream writes the next mark value here (after everything it
  queued so far: the forward pass that wrote a store's KV, the last kernels
  that used a load's pages); the request carries that value as ``after``,
  and the daemon, polling the word from the host, queues the copy only once
  it is reached. The daemon never puts anything of the engine's into its
  own streams.
- per load slot ``s`` (``slots`` of them), ``num_layers + 4`` words:
  ``layer[l]`` (the daemon writes the load's ``seq`` once layer ``l``
  landed; the engine's stream waits for it), ``done`` (the daemon writes
  ``seq`` after the last copy of the load: from then on it will never write
  the load's pages), ``cancel`` (the client writes ``seq`` to cancel: copy
  kernels that have not started skip the load's pages), one spare word.

Who may release what: the daemon writes layer and done words from its
streams (or its CPU when nothing was queued); the client writes the layer
and done words itself only after it wrote ``cancel`` and the daemon can no
longer write (it is dead, or the quiet period after the cancel passed), so
a released wait is always a failed load.
"""

from __future__ import annotations

from dataclasses import dataclass

MAGIC = 0x4644564B  # b"KVDF" little-endian
VERSION = 1
HEADER_WORDS = 8
MARK_WORD = 4
SLOT_EXTRA = 4  # done, cancel, 2 spare
MAX_SLOTS = 256
MAX_LAYERS = 1024
PAGE = 4096
SEQ_MASK = 0xFFFFFFFF


def reached(value: int, seq: int) -> bool:
    """``value`` is at or past ``seq`` in cyclic uint32 order (CUDA's GEQ wait)."""
    return ((value - seq) & SEQ_MASK) < 0x80000000


@dataclass(frozen=True)
class FlagLayout:
    num_layers: int
    slots: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_layers <= MAX_LAYERS:
            raise ValueError(f"num_layers must be 1..{MAX_LAYERS}")
        if not 1 <= self.slots <= MAX_SLOTS:
            raise ValueError(f"slots must be 1..{MAX_SLOTS}")

    @property
    def slot_words(self) -> int:
        return self.num_layers + SLOT_EXTRA

    @property
    def words(self) -> int:
        return HEADER_WORDS + self.slots * self.slot_words

    @property
    def size(self) -> int:
        """Bytes of the file: whole pages (the driver registers page ranges)."""
        return -(-self.words * 4 // PAGE) * PAGE

    def layer_word(self, slot: int, layer: int) -> int:
        return HEADER_WORDS + slot * self.slot_words + layer

    def done_word(self, slot: int) -> int:
        return HEADER_WORDS + slot * self.slot_words + self.num_layers

    def cancel_word(self, slot: int) -> int:
        return self.done_word(slot) + 1

    def header(self) -> list[int]:
        return [MAGIC, VERSION, self.num_layers, self.slots]
