"""The fake GPU's one error type, with CUDA's status codes, and its sticky context error.

``CudaError(code, what)`` is what every fake runtime and driver call raises
(the cupy shim exposes it as ``cupy.cuda.runtime.CUDARuntimeError`` and
``cupy.cuda.driver.CUDADriverError``, so kvd's start-up sorts it as "CUDA
unavailable" exactly as it does the real ones). As on a real GPU, a fault
inside queued work (an illegal address in a kernel, a DMA or a stream
memory operation) breaks the process's context for good: ``fail(exc)``
records it, every later call raises it (``check()``), and the fake writes
one line to stderr (the daemon's log) so a test can see it.
"""

from __future__ import annotations

import sys
import threading

INVALID_VALUE = 1
MEMORY_ALLOCATION = 2
ILLEGAL_ADDRESS = 700
MISALIGNED_ADDRESS = 716
HOST_MEMORY_ALREADY_REGISTERED = 712
HOST_MEMORY_NOT_REGISTERED = 713
INVALID_HANDLE = 400
NOT_SUPPORTED = 801
NOT_READY = 600

NAMES = {INVALID_VALUE: "cudaErrorInvalidValue", MEMORY_ALLOCATION: "cudaErrorMemoryAllocation",
         ILLEGAL_ADDRESS: "cudaErrorIllegalAddress",
         MISALIGNED_ADDRESS: "cudaErrorMisalignedAddress",
         HOST_MEMORY_ALREADY_REGISTERED: "cudaErrorHostMemoryAlreadyRegistered",
         HOST_MEMORY_NOT_REGISTERED: "cudaErrorHostMemoryNotRegistered",
         INVALID_HANDLE: "cudaErrorInvalidResourceHandle", NOT_SUPPORTED: "cudaErrorNotSupported",
         NOT_READY: "cudaErrorNotReady"}


class CudaError(RuntimeError):
    def __init__(self, code: int, what: str = "") -> None:
        self.status = code
        super().__init__(f"{NAMES.get(code, code)}: {what}" if what else NAMES.get(code, str(code)))


_sticky: CudaError | None = None
_lock = threading.Lock()


def fail(exc: CudaError) -> None:
    """A fault in queued work: the context is broken from now on."""
    global _sticky
    with _lock:
        first = _sticky is None
        if first:
            _sticky = exc
    if first:
        print(f"fakecuda: context broken by queued work: {exc}", file=sys.stderr, flush=True)


def check() -> None:
    """Raise the sticky error, if any (every API call starts here)."""
    if _sticky is not None:
        raise _sticky


def broken() -> bool:
    return _sticky is not None


def reset() -> CudaError | None:
    """Forget the sticky error and return it: a test harness's fresh context (a real
    process would have to exit); the engine fixture calls it between tests."""
    global _sticky
    with _lock:
        was, _sticky = _sticky, None
    return was
