"""An engine's KV tensors in CUDA virtual memory, as ``cuda_vmm`` buffers lent by file descriptor.

``vmm_buffers(spans, device_uuid)`` finds the physical allocations under each tensor
(kvd_protocol.cuda_vmm) and returns the register request's buffers (one per run mapped end
to end), the allocation bases to lend and each tensor's ``(buffer, offset)``. ``lend(...)``
exports a descriptor per allocation, lends them over fds.sock (kvd_protocol.fd_pass), closes
them here whatever happens, and returns buffers naming the daemon's token. No torch.
"""

from __future__ import annotations

import os

from kvd_protocol import cuda_vmm, fd_pass
from kvd_protocol.cuda_driver import ensure_context


def vmm_buffers(spans, device_uuid: str) -> tuple[list[dict], list[int], list[tuple[int, int]]]:
    pieces = {}
    for ptr, nbytes in spans:
        for p in cuda_vmm.mapped_pieces(ptr, nbytes):
            pieces[p.base] = p
    runs = []  # [start, end, [pieces]]
    for p in sorted(pieces.values(), key=lambda p: p.base):
        if runs and runs[-1][1] == p.base:
            runs[-1][1] = p.base + p.size
            runs[-1][2].append(p)
        else:
            runs.append([p.base, p.base + p.size, [p]])
    buffers, bases = [], []
    for start, end, run in runs:
        buffers.append({"kind": "cuda_vmm", "token": bytes(fd_pass.TOKEN_BYTES), "offset": 0,
                        "pieces": [p.size for p in run], "size": end - start,
                        "device_uuid": device_uuid})
        bases.extend(p.base for p in run)
    place = []
    for ptr, _ in spans:
        i = next(i for i, (start, end, _) in enumerate(runs) if start <= ptr < end)
        place.append((i, ptr - runs[i][0]))
    return buffers, bases, place


def lend(piece_bases: list[int], buffers: list[dict], device_index: int, fd_socket,
         timeout: float) -> list[dict]:
    ensure_context(device_index)  # the client may register from a thread of its own
    fds = []
    try:
        for base in piece_bases:
            fds.append(cuda_vmm.export_fd(base))
        token = fd_pass.lend(fd_socket, fds, timeout)
    finally:
        for fd in fds:
            os.close(fd)
    return [{**b, "token": token} for b in buffers]
