"""A load's flag words as the CUDA backend writes and reads them on the GPU.

``GpuSignal.of(signal)`` turns a kvd.copy.flags ``LoadSignal`` into device addresses of its
slot's words (the flag page is host-mapped). ``layers_landed``/``done`` queue
``cuStreamWriteValue32`` writes ordered after the stream's work; ``cancel`` is the
``(address, seq)`` the copy kernels check. Since the engine's CPU can write these words
too, no wait of the engine's ever depends on the daemon being alive.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.copy.flags import LoadSignal
from kvd_protocol import cuda_driver


@dataclass(frozen=True)
class GpuSignal:
    source: LoadSignal

    @classmethod
    def of(cls, signal: LoadSignal | None) -> "GpuSignal | None":
        return None if signal is None else cls(signal)

    @property
    def layerwise(self) -> bool:
        return self.source.layerwise

    @property
    def cancel(self) -> tuple[int, int]:
        s = self.source
        return s.page.addr(s.page.layout.cancel_word(s.slot)), s.seq

    def layers_landed(self, stream, layers) -> None:
        s = self.source
        for layer in layers:
            cuda_driver.stream_write_u32(stream_ptr(stream), s.page.addr(s.page.layout.layer_word(
                s.slot, layer)), s.seq)

    def done(self, stream) -> None:
        s = self.source
        cuda_driver.stream_write_u32(stream_ptr(stream), s.page.addr(s.page.layout.done_word(s.slot)),
                                     s.seq)


def stream_ptr(stream) -> int:
    return int(getattr(stream, "ptr", stream))
