"""The flag page: completion signals either side can raise, so no death hangs the other.

One small shared-memory file per registration, made by the client, mapped by both and on
CUDA registered with the driver, so streams (``cuStreamWriteValue32``/``WaitValue32``) and
CPUs read and write its little-endian uint32 words; seqs compare cyclically (``reached``).
``FlagLayout``: header words, the engine's ``MARK_WORD`` (the daemon queues a copy only once
the mark it was sent with is reached) and per load slot ``layer[l]``, ``done``, ``cancel``.
The daemon writes layer/done words; the client writes them only after ``cancel`` and once
the daemon can no longer write, so a released wait is always a failed load.
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
