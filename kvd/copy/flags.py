"""The daemon's side of a registration's flag page (layout: kvd_protocol.flags).

``FlagPage.open(spec, layout, shm_dir, forbid)`` maps the client's flag file (checked as a
pool buffer: kvd.copy.shm_file) and checks its header. Reads the engine's mark word
(``engine_reached``: polled by kvd.copy.poll, never waited on in a stream) and a load
slot's cancel word; writes a load slot's layer and done words from the CPU (``signal_*``,
``release``) or, once registered with the driver, from a CUDA stream (``addr``).
``LoadSignal`` is what a copy plan carries: page, slot, seq, layer-wise or not.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvd_protocol.errors import BadRequest
from kvd_protocol.flags import MAGIC, MARK_WORD, VERSION, FlagLayout, reached

from .shm_file import map_shm_file


class _Reached:
    """``done`` once word ``index`` of ``words`` is at or past ``seq``."""

    __slots__ = ("words", "index", "seq")

    def __init__(self, words: np.ndarray, index: int, seq: int) -> None:
        self.words, self.index, self.seq = words, index, seq

    @property
    def done(self) -> bool:
        return reached(int(self.words[self.index]), self.seq)


class FlagPage:
    def __init__(self, mm: mmap.mmap, layout: FlagLayout) -> None:
        self._map = mm
        self.layout = layout
        self.words = np.frombuffer(mm, dtype="<u4", count=layout.words)
        self.ptr = self.words.ctypes.data  # host address of word 0
        self.size = layout.size

    @classmethod
    def open(cls, spec: dict, layout: FlagLayout, shm_dir: Path,
             forbid: tuple[int, int] | None = None, owner_uid: int | None = None) -> "FlagPage":
        mm = map_shm_file(spec["path"], layout.size, shm_dir, "flags", forbid, owner_uid)
        page = cls(mm, layout)
        if [int(w) for w in page.words[:4]] != [MAGIC, VERSION, layout.num_layers, layout.slots]:
            page.close()
            raise BadRequest("flags: the file's header does not match kvd_protocol.flags "
                             f"version {VERSION} with {layout.num_layers} layers and "
                             f"{layout.slots} slots")
        return page

    def addr(self, word: int) -> int:
        return self.ptr + 4 * word

    def engine_reached(self, value: int) -> _Reached:
        return _Reached(self.words, MARK_WORD, value)

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.layout.slots:
            raise BadRequest(f"slot {slot} is not one of the {self.layout.slots} load slots")

    def cancelled(self, slot: int, seq: int) -> bool:
        return int(self.words[self.layout.cancel_word(slot)]) == seq

    def signal_layer(self, slot: int, layer: int, seq: int) -> None:
        self.words[self.layout.layer_word(slot, layer)] = seq

    def signal_done(self, slot: int, seq: int) -> None:
        self.words[self.layout.done_word(slot)] = seq

    def release(self, slot: int, seq: int, layerwise: bool) -> None:
        """CPU-signal a load nothing was queued for: every wait on it is released."""
        if layerwise:
            first = self.layout.layer_word(slot, 0)
            self.words[first:first + self.layout.num_layers] = seq
        self.signal_done(slot, seq)

    def close(self) -> None:
        self.words = None
        try:
            self._map.close()
        except BufferError:
            pass  # a copy thread still holds a view; unmapped when it is collected


@dataclass(frozen=True)
class LoadSignal:
    """How a load reports progress: ``page``'s words of ``slot``, value ``seq``."""

    page: FlagPage
    slot: int
    seq: int
    layerwise: bool

    @property
    def cancelled(self) -> bool:
        return self.page.cancelled(self.slot, self.seq)

    def release(self) -> None:
        self.page.release(self.slot, self.seq, self.layerwise)
