"""The client's side of a registration's flag page (layout: kvd_protocol.flags).

``ClientFlags(num_layers, slots, shm_dir, device, group)`` creates the page in shared memory
(kvd_client.shm; removed at ``close`` and exit) and, for a CUDA pool, registers it with the
driver. ``mark(stream, value)``: the stream writes the mark word once its earlier work ran
(the daemon starts a store then); ``stream_idle``; ``wait_layer``: the stream waits for a
load's layer word; ``cancel``, ``done`` and ``release_waits`` (the CPU writes every layer
word of a failed load, so no stream waits on it any more).
"""

from __future__ import annotations

import atexit

import numpy as np

from kvd_protocol import cuda_driver
from kvd_protocol.flags import MARK_WORD, FlagLayout, reached

from . import shm


class ClientFlags:
    def __init__(self, num_layers: int, slots: int, shm_dir: str = "/dev/shm", device: int | None = None,
                 group: int | None = None):
        self.layout = FlagLayout(num_layers, slots)
        self._file = shm.ShmFile.create("kvd-flags", self.layout.size, shm_dir, group)
        self.path = self._file.path
        self.words = np.frombuffer(self._file.map, dtype="<u4")
        self.words[:4] = self.layout.header()
        self.ptr = self.words.ctypes.data
        self.device = device
        self.dev_base = None
        if device is not None:
            try:
                self.dev_base = cuda_driver.register_host(self.ptr, self.layout.size, device)
            except BaseException:
                self.close()
                raise
        atexit.register(self.close)

    @property
    def spec(self) -> dict:
        return {"path": str(self.path), "size": self.layout.size, "slots": self.layout.slots}

    def _dev(self, word: int) -> int:
        return self.dev_base + 4 * word

    def mark(self, stream: int, value: int) -> None:
        cuda_driver.ensure_context(self.device)  # the calling thread may never have used CUDA
        cuda_driver.stream_write_u32(stream, self._dev(MARK_WORD), value)

    def stream_idle(self, stream: int) -> bool:
        """True when ``stream`` has run everything queued on it so far."""
        cuda_driver.ensure_context(self.device)
        return cuda_driver.stream_idle(stream)

    def wait_layer(self, stream: int, slot: int, layer: int, seq: int) -> None:
        cuda_driver.ensure_context(self.device)
        cuda_driver.stream_wait_u32(stream, self._dev(self.layout.layer_word(slot, layer)), seq)

    def layer_landed(self, slot: int, layer: int, seq: int) -> bool:
        return reached(int(self.words[self.layout.layer_word(slot, layer)]), seq)

    def cancel(self, slot: int, seq: int) -> None:
        self.words[self.layout.cancel_word(slot)] = seq

    def done(self, slot: int, seq: int) -> bool:
        return reached(int(self.words[self.layout.done_word(slot)]), seq)

    def release_waits(self, slot: int, seq: int) -> None:
        first = self.layout.layer_word(slot, 0)
        layers = self.words[first:first + self.layout.num_layers]
        behind = np.array([not reached(int(w), seq) for w in layers])
        layers[behind] = seq  # never move a word backwards

    def close(self) -> None:
        if getattr(self, "_file", None) is None:
            return
        if self.dev_base is not None:
            try:
                cuda_driver.unregister_host(self.ptr)
            except Exception:  # noqa: BLE001 - a context already torn down at exit
                pass
            self.dev_base = None
        self.words = None
        self._file.close()
        self._file = None
