"""``cupy.cuda.runtime`` of the fake GPU: the runtime calls kvd's CUDA backend makes.

Devices: ``FAKECUDA_DEVICES`` of them (default 1), each with a fixed UUID
(``device_uuid(i)``), so the daemon and engines agree on it as real
processes do. Every call first raises the context's sticky error, if any
(fakecuda.errors). Copies check their direction against the memory they
name, as a real DMA would fault on a wrong one: ``HostToDevice`` reads
registered or pinned host memory and writes device memory (own or IPC),
``DeviceToHost`` the other way, ``DeviceToDevice`` device on both sides,
``Default`` takes whatever is there; a copy never spans two regions (one
DMA stays inside one registration). ``pointerGetAttributes`` reports
``devicePointer == ptr`` for memory the GPU can reach and 0 for
unregistered host memory, as CUDA 11+ does for unregistered pointers.
Async calls queue on the stream whose handle they get (fakecuda.streams).
"""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace

import numpy as np

from . import errors, streams
from .errors import INVALID_VALUE, MEMORY_ALLOCATION, CudaError
from .memory import SPACE

CUDARuntimeError = CudaError
memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice, memcpyDefault = range(5)
HOST, DEVICE = ("host", "pinned"), ("device", "ipc", "vmm")
_SIDES = {memcpyHostToHost: (HOST, HOST), memcpyHostToDevice: (HOST, DEVICE),
          memcpyDeviceToHost: (DEVICE, HOST), memcpyDeviceToDevice: (DEVICE, DEVICE),
          memcpyDefault: ((), ())}  # (source kinds, destination kinds)
MULTIPROCESSORS = 8


def device_count() -> int:
    return int(os.environ.get("FAKECUDA_DEVICES", "1") or 1)


def device_uuid(ordinal: int) -> bytes:
    return bytes.fromhex("fa4ecda0") + ordinal.to_bytes(4, "little") + b"fakecuda"


def getDeviceCount() -> int:
    errors.check()
    return device_count()


def getDeviceProperties(ordinal: int) -> dict:
    errors.check()
    if not 0 <= ordinal < device_count():
        raise CudaError(INVALID_VALUE, f"no device {ordinal}")
    # CuPy hands cudaDeviceProp.uuid over as a C string: cut at its first 0 byte (seen on an
    # H100 whose UUID has one), as the fake's UUIDs all do
    return {"name": f"Fake GPU {ordinal}".encode(), "uuid": device_uuid(ordinal).split(b"\0")[0],
            "multiProcessorCount": MULTIPROCESSORS, "unifiedAddressing": 1}


def deviceSynchronize() -> None:
    streams.synchronize_all()


# ---- memory -----------------------------------------------------------------------

def malloc(size: int) -> int:
    errors.check()
    return SPACE.alloc(size).base


def free(ptr: int) -> None:
    errors.check()
    SPACE.free(ptr)


_REGISTER_CALLS = itertools.count(1)
_FAIL_REGISTER = int(os.environ.get("FAKECUDA_FAIL_HOST_REGISTER", "0") or 0)


def hostRegister(ptr: int, size: int, flags: int) -> None:
    errors.check()
    if next(_REGISTER_CALLS) == _FAIL_REGISTER:  # the test knob: this one call fails, once
        raise CudaError(MEMORY_ALLOCATION, "hostRegister (FAKECUDA_FAIL_HOST_REGISTER)")
    SPACE.host_register(ptr, size)


def hostUnregister(ptr: int) -> None:
    errors.check()
    SPACE.host_unregister(ptr)


def pointerGetAttributes(ptr: int) -> SimpleNamespace:
    errors.check()
    r = SPACE.find(ptr)
    if r is None:
        return SimpleNamespace(type=0, device=-2, devicePointer=0, hostPointer=0)
    on_device = r.kind in DEVICE
    return SimpleNamespace(type=2 if on_device else 1, device=r.device, devicePointer=ptr,
                           hostPointer=0 if on_device else ptr)


def ipcGetMemHandle(ptr: int) -> bytes:
    errors.check()
    return SPACE.ipc_handle(ptr)


def ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:
    errors.check()
    return SPACE.ipc_open(handle)


def ipcCloseMemHandle(ptr: int) -> None:
    errors.check()
    SPACE.ipc_close(ptr)


# ---- copies -----------------------------------------------------------------------

def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    memcpy2DAsync(dst, size, src, size, size, 1, kind, stream)


def memcpy(dst: int, src: int, size: int, kind: int) -> None:
    memcpyAsync(dst, src, size, kind, 0)
    streams.default_stream().synchronize()


def memcpy2DAsync(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                  kind: int, stream: int) -> None:
    """``height`` rows of ``width`` bytes, rows ``spitch`` apart at ``src`` and ``dpitch``
    apart at ``dst``; checked (pitches, direction) when queued, copied when run."""
    errors.check()
    if kind not in _SIDES or width < 0 or height < 0 or (height > 1 and (spitch < width or dpitch < width)):
        raise CudaError(INVALID_VALUE, f"memcpy2D kind={kind} width={width} height={height} "
                                       f"pitches={spitch}/{dpitch}")
    s = streams.stream_at(stream)
    if width == 0 or height == 0:
        return
    src_kinds, dst_kinds = _SIDES[kind]
    SPACE.resolve(src, spitch * (height - 1) + width, src_kinds, "memcpy source")
    SPACE.resolve(dst, dpitch * (height - 1) + width, dst_kinds, "memcpy destination")
    s.enqueue(lambda: _copy2d(dst, dpitch, src, spitch, width, height, src_kinds, dst_kinds))


def _copy2d(dst, dpitch, src, spitch, width, height, src_kinds, dst_kinds) -> None:
    s_reg, s_off = SPACE.resolve(src, spitch * (height - 1) + width, src_kinds, "memcpy source")
    d_reg, d_off = SPACE.resolve(dst, dpitch * (height - 1) + width, dst_kinds, "memcpy destination")
    strided = np.lib.stride_tricks.as_strided
    rows = strided(s_reg.array[s_off:], shape=(height, width), strides=(spitch, 1))
    strided(d_reg.array[d_off:], shape=(height, width), strides=(dpitch, 1))[:] = rows


# ---- streams and events -----------------------------------------------------------

def streamCreate() -> int:
    errors.check()
    return streams.Stream().ptr


def streamCreateWithFlags(flags: int) -> int:
    return streamCreate()


def streamSynchronize(stream: int) -> None:
    streams.stream_at(stream).synchronize()


def streamWaitEvent(stream: int, event: int, flags: int = 0) -> None:
    errors.check()
    streams.stream_at(stream).wait_event(streams.event_at(event))


def eventCreate() -> int:
    errors.check()
    return streams.new_event_handle()


def eventCreateWithFlags(flags: int) -> int:
    return eventCreate()


def eventRecord(event: int, stream: int) -> None:
    errors.check()
    streams.event_at(event).record(streams.stream_at(stream))


def eventQuery(event: int) -> int:
    return 0 if streams.event_at(event).done else 600  # cudaErrorNotReady


def eventSynchronize(event: int) -> None:
    streams.event_at(event).synchronize()


def eventDestroy(event: int) -> None:
    errors.check()
    streams.destroy_event(event)
