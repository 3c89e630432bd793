"""Opening an engine's CUDA pool buffers in the daemon: ``cuda_ipc`` and ``cuda_vmm``.

``open_all`` opens each buffer on the device (current on this thread) and
returns the address of each buffer's first byte, appending what it opened to
``opened`` as it goes, so a caller that sees it fail closes exactly that
(``close_all``). Each buffer's ``offset + size`` is checked against what was
opened; anything refused is ``BadRequest``.

- ``cuda_ipc``: a legacy CUDA IPC handle, opened once (lazy peer access).
- ``cuda_vmm``: one contiguous range of the engine's virtual memory made of
  ``pieces`` (each one physical allocation, in address order) whose file
  descriptors the service took from fds.sock (``fds``, kvd.server.fd_intake);
  mapped side by side here (kvd_protocol.cuda_vmm checks sizes, granularity
  and the GPU), so the mapping's base plus the buffer's ``offset`` addresses
  what the engine's base plus offset does. The caller closes the descriptors.
"""

from __future__ import annotations

from kvd_protocol import cuda_driver, cuda_vmm
from kvd_protocol.cuda_driver import CudaExportError
from kvd_protocol.errors import BadRequest

IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess


def open_all(rt, buffers: list[dict], opened: list, ordinal: int) -> list[int]:
    ptrs = []
    for i, b in enumerate(buffers):
        if b["kind"] == "cuda_vmm":
            opened.append(_map(b, i, ordinal))
            ptrs.append(opened[-1].base + b["offset"])
            continue
        try:
            base = rt.ipcOpenMemHandle(b["handle"], IPC_LAZY_PEER)
        except Exception as exc:  # a handle this process cannot open is the client's
            raise BadRequest(f"buffers[{i}]: cannot open the CUDA IPC handle: {exc}") from None
        opened.append(base)
        if b["offset"] + b["size"] > cuda_driver.allocation_size(base):
            raise BadRequest(f"buffers[{i}]: offset + size exceed the shared allocation")
        ptrs.append(base + b["offset"])
    return ptrs


def close_all(rt, opened: list) -> None:
    """Close IPC bases and unmap virtual-memory mappings (after the pool's copies ended)."""
    for item in opened:
        if isinstance(item, cuda_vmm.VmmMapping):
            item.close()
        else:
            rt.ipcCloseMemHandle(item)


def _map(b: dict, i: int, ordinal: int) -> cuda_vmm.VmmMapping:
    try:
        mapping = cuda_vmm.map_fds(b["fds"], list(b["pieces"]), ordinal)
    except CudaExportError as exc:
        raise BadRequest(f"buffers[{i}]: cannot map the virtual-memory pieces: {exc}") from None
    if b["offset"] + b["size"] > mapping.size:
        mapping.close()
        raise BadRequest(f"buffers[{i}]: offset + size exceed the pieces' {mapping.size} bytes")
    return mapping


def vmm_supported(ordinals) -> bool:
    """Whether every one of these GPUs imports allocations by file descriptor."""
    try:
        return all(cuda_vmm.fd_export_supported(o) for o in ordinals)
    except (CudaExportError, AttributeError):  # an old driver, or the test suite's fake one
        return False
