"""The buffers a register request names for an engine's CUDA KV tensors.

``CudaBuffers(spans, device_index)`` takes each tensor's ``(address, bytes)``: ``cuda_ipc``
buffers, one per ordinary CUDA allocation, or, when every tensor lies in CUDA virtual
memory (vLLM 0.34's extensible KV cache, sleep mode, expandable segments), ``cuda_vmm``
buffers whose file descriptors ``lend`` passes to the daemon at each registration
(kvd_client.vmm_share). ``place``: each tensor's ``(buffer, offset)``. Tensors that mix
both kinds raise ``ValueError``. ``torch_extent`` and ``torch_device_index`` read a torch
tensor's span and GPU; torch is imported only to ask for the current device.
"""

from __future__ import annotations

from kvd_protocol import cuda_vmm
from kvd_protocol.cuda_driver import device_uuid, export_allocation

from . import vmm_share


class CudaBuffers:
    def __init__(self, spans: list[tuple[int, int]], device_index: int):
        vmm = [cuda_vmm.is_vmm(ptr) for ptr, _ in spans]
        if any(vmm) and not all(vmm):
            raise ValueError("these KV tensors mix virtual-memory and ordinary CUDA allocations")
        self.device_index = device_index
        self.lends_fds = bool(vmm) and all(vmm)  # lend() at each registration, else CUDA IPC
        self.piece_bases: list[int] = []
        if self.lends_fds:
            self.buffers, self.piece_bases, self.place = vmm_share.vmm_buffers(
                spans, device_uuid(device_index))
        else:
            self.buffers, self.place = _ipc_buffers(spans)

    def lend(self, fd_socket, timeout: float) -> list[dict]:
        """The buffers, their allocations' file descriptors lent to the daemon anew."""
        return vmm_share.lend(self.piece_bases, self.buffers, self.device_index, fd_socket, timeout)


def _ipc_buffers(spans) -> tuple[list[dict], list[tuple[int, int]]]:
    """One cuda_ipc buffer per allocation; each tensor's (buffer, offset)."""
    buffers, index, place = [], {}, []
    for ptr, _ in spans:
        alloc = export_allocation(ptr)  # its error says what to change if it cannot
        if alloc.base not in index:
            index[alloc.base] = len(buffers)
            buffers.append({"kind": "cuda_ipc", "handle": alloc.handle, "offset": 0,
                            "size": alloc.size, "device_uuid": alloc.device_uuid})
        place.append((index[alloc.base], ptr - alloc.base))
    return buffers, place


def torch_extent(t) -> int:
    """Bytes from a torch tensor's first element to just past its last."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def torch_device_index(t) -> int:
    """The GPU a torch tensor lives on: its device's index, else the current device."""
    if t.device.index is not None:
        return t.device.index
    import torch

    return torch.cuda.current_device()
