"""KV tensors in CUDA virtual memory, as vLLM 0.34's extensible KV cache lays them out.

``vmm_layers(torch, layer_bytes, layers, chunks_per_layer)`` reserves one address range
and maps per layer ``chunks_per_layer`` physical allocations exportable as file
descriptors, each layer on a granularity boundary, and returns one uint8 tensor per layer.
A ``VmmMemory`` (kvd_protocol.cuda_vmm) owns the memory, kept alive by each tensor and freed
after the last. Used by ``kvd bench --gpu --gpu-pool vmm`` and the GPU tests.
"""

from __future__ import annotations

from kvd_protocol import cuda_vmm


class VmmMemory:
    """Owns the mapping; exposes it to torch as one uint8 array."""

    def __init__(self, sizes: list[int], ordinal: int, synchronize):
        self.mapping = cuda_vmm.allocate(sizes, ordinal)
        self.synchronize = synchronize
        self.__cuda_array_interface__ = {"shape": (self.mapping.size,), "typestr": "|u1",
                                         "data": (self.mapping.base, False), "version": 3,
                                         "strides": None}

    def __del__(self):
        if getattr(self, "mapping", None) is None or not self.mapping.base:
            return
        try:
            self.synchronize()  # nothing queued may still use it
            self.mapping.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone first
            pass


def vmm_layers(torch, layer_bytes: int, layers: int, chunks_per_layer: int = 1,
               device: int | None = None) -> list:
    ordinal = torch.cuda.current_device() if device is None else device
    grain = cuda_vmm.granularity(ordinal)
    chunk = -(-layer_bytes // (chunks_per_layer * grain)) * grain
    segment = chunk * chunks_per_layer
    memory = VmmMemory([chunk] * (chunks_per_layer * layers), ordinal,
                       lambda: torch.cuda.synchronize(ordinal))
    whole = torch.as_tensor(memory, device=f"cuda:{ordinal}")
    return [whole[i * segment:i * segment + layer_bytes] for i in range(layers)]
