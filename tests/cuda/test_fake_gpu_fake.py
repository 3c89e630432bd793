"""The fake GPU itself (tests/fakecuda) keeps the promises the backend tests lean on.

- Its kernels match the numpy reference (kvd.copy.host_ops) on a layer
  subrange, copy nothing once the cancel word holds the sequence number,
  and its ``RawModule`` accepts kernels/kv_copy.cu and refuses a kernel
  whose parameters changed.
- Its streams order work: a stream waiting on another's event runs after
  it; a ``wait_value32`` holds its stream until a CPU writes the word;
  ``cuStreamQuery`` says whether a stream ran what was queued.
- It faults where a GPU would: a kernel reading host memory nobody
  registered breaks the context, and every later call raises.
- IPC: another process maps the same device memory through a handle.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from fakecuda import errors, kernels, runtime, streams
from fakecuda.memory import SPACE

from kvd.copy import host_ops
from kvd.cuda.kernels import desc_params, kernel_source_path, plane_bases, vector_bytes

CHUNK = 16


def _launch(kind: str, desc, bases, pages, chunk_ptrs, layers: range, stream, cancel=(0, 0)):
    """The launch KernelCopier makes, by hand: tables in device memory, then the kernel."""
    tables = np.concatenate([bases.view(np.int64), np.asarray(pages, np.int64),
                             np.asarray(chunk_ptrs, np.uint64).view(np.int64)])
    dev = SPACE.alloc(tables.nbytes)
    dev.array[:] = tables.view(np.uint8)
    p = desc_params(desc)
    vec = vector_bytes(p["row_bytes"], p["page_stride"], p["token_stride"], bases,
                       np.asarray(chunk_ptrs, np.uint64), p["heads"], p["head_stride"])
    args = (dev.base, dev.base + 8 * bases.size, dev.base + 8 * (bases.size + len(pages)),
            len(chunk_ptrs), p["num_layers"], p["planes"], layers.start, layers.stop, CHUNK,
            p["page_size"], p["page_stride"], p["token_stride"], p["row_bytes"], p["heads"],
            p["head_stride"], vec, *cancel)
    kernels.Kernel(f"kv_{kind}")((1,), (128,), args, stream=stream)
    return dev


def test_kernels_match_the_numpy_reference_and_honour_cancel(fake_engine):
    tensors, _, region = fake_engine.tensors("vllm_flash_attn", 4, 16, 4, 2, 32, seed=3)
    desc = fake_engine.pool("vllm_flash_attn", tensors, 4).descriptor
    bases = plane_bases(desc, [region.base])
    shard = desc.shard_bytes(CHUNK)
    host = SPACE.alloc_pinned(4 * shard + 4)
    arena = np.frombuffer(host.owner, np.uint8)
    arena[:] = np.random.default_rng(4).integers(0, 256, arena.size, dtype=np.uint8)
    arena[-4:] = 0  # the cancel word
    pages, offsets = np.arange(8, 16), [0, 2 * shard]
    want = region.array.copy()
    host_ops.scatter([want], arena, desc, CHUNK, pages, offsets, layers=range(1, 3))
    s = fake_engine.stream
    cancel = (host.base + arena.size - 4, 7)
    tables = _launch("scatter", desc, bases, pages, [host.base + o for o in offsets], range(1, 3),
                     s, cancel)
    assert s.synchronize(timeout=10)
    assert np.array_equal(region.array, want)
    arena[-4:] = np.array([7], "<u4").view(np.uint8)  # cancelled: the next launch copies nothing
    region.array[:] = 0
    tables2 = _launch("scatter", desc, bases, pages, [host.base + o for o in offsets], range(4), s,
                      cancel)
    assert s.synchronize(timeout=10) and not region.array.any()
    SPACE.free(tables.base)
    SPACE.free(tables2.base)


def test_raw_module_checks_the_kernel_signature():
    source = kernel_source_path().read_text()
    module = kernels.RawModule(code=source)
    assert module.get_function("kv_gather").gather and not module.get_function("kv_scatter").gather
    with pytest.raises(errors.CudaError, match="update tests/fakecuda"):
        kernels.RawModule(code=source.replace("int layer_begin, int layer_end", "int layer_end"))
    with pytest.raises(errors.CudaError):
        module.get_function("xxh3_segments")


def test_streams_order_work_through_events_and_flag_words():
    a, b = streams.Stream(), streams.Stream()
    word = SPACE.alloc_pinned(4)
    flag = np.frombuffer(word.owner, "<u4")
    ran = []
    a.sleep(0.2)
    a.launch(lambda: ran.append("a"))
    ev = streams.Event()
    ev.record(a)
    b.wait_event(ev)
    b.launch(lambda: ran.append("b"))
    b.wait_value32(word.base, 5)
    b.launch(lambda: ran.append("after the word"))
    assert not ev.done and b.synchronize(timeout=0.1) is False
    assert a.synchronize(timeout=10) and ev.done
    flag[0] = 4
    assert b.synchronize(timeout=0.2) is False and ran == ["a", "b"]
    flag[0] = 5  # a CPU releases the stream's wait
    assert b.synchronize(timeout=10) and ran == ["a", "b", "after the word"]


def test_stream_idle_says_whether_queued_work_ran(fake_engine):
    """``cuda_driver.stream_idle`` (the client's no-mark check): True on an idle stream,
    False while queued work has not run, and an unknown stream is an error, not idle."""
    from kvd_protocol import cuda_driver
    s = streams.Stream()
    assert cuda_driver.stream_idle(s.ptr)
    s.sleep(0.3)
    assert not cuda_driver.stream_idle(s.ptr)
    assert s.synchronize(timeout=10) and cuda_driver.stream_idle(s.ptr)
    with pytest.raises(cuda_driver.CudaExportError, match="cuStreamQuery"):
        cuda_driver.stream_idle(0xDEAD0000)


def test_a_kernel_on_unregistered_host_memory_breaks_the_context():
    s = streams.Stream()
    loose = np.zeros(4096, np.uint8)
    args = (loose.ctypes.data, 0, 0, 1, 1, 1, 0, 1, 16, 16, 0, 0, 16, 1, 0, 16, 0, 0)
    try:
        kernels.Kernel("kv_gather")((1,), (32,), args, stream=s)
        with pytest.raises(errors.CudaError, match="IllegalAddress"):
            s.synchronize(timeout=10)
        with pytest.raises(errors.CudaError, match="IllegalAddress"):
            runtime.getDeviceCount()
    finally:
        assert errors.reset() is not None


def _map_and_write(handle: bytes, q) -> None:
    from fakecuda import runtime as rt
    from fakecuda.memory import SPACE as space
    ptr = rt.ipcOpenMemHandle(handle)
    space.view(ptr, 4).view("<u4")[0] = 0xC0FFEE
    q.put(int(space.view(ptr + 4, 4).view("<u4")[0]))
    rt.ipcCloseMemHandle(ptr)


def test_ipc_maps_the_same_memory_in_another_process():
    region = SPACE.alloc(8192)
    try:
        region.array[4:8] = np.array([1234], "<u4").view(np.uint8)
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_map_and_write, args=(runtime.ipcGetMemHandle(region.base), q))
        p.start()
        assert q.get(timeout=60) == 1234
        p.join(30)
        assert p.exitcode == 0
        assert int(region.array[:4].view("<u4")[0]) == 0xC0FFEE
        with pytest.raises(errors.CudaError):
            runtime.ipcOpenMemHandle(runtime.ipcGetMemHandle(region.base))  # not one's own
    finally:
        SPACE.free(region.base)
