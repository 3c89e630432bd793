"""Opening an engine's CUDA pool buffers in the daemon: ``cuda_ipc`` and ``cuda_vmm``.

``open_all`` opens each buffer on the current device and returns each buffer's address,
appending what it opened to ``opened`` as it goes so a failing caller closes exactly that
(``close_all``). ``cuda_ipc``: a legacy IPC handle; ``cuda_vmm``: pieces of the engine's
virtual memory mapped side by side from file descriptors (kvd.server.fd_intake;
kvd_protocol.cuda_vmm checks them). ``offset + size`` is checked against what was opened;
anything refused is ``BadRequest``. The caller closes the descriptors.
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
