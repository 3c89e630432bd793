"""A fake GPU on numpy, so kvd's real CUDA backend runs end to end in CI without one.

kvd.cuda (backend, staging ring, kernel copier, signals) is unchanged: a
test starts a real ``kvd serve --gpu on`` whose PYTHONPATH starts with
``shim/`` (``daemon_env``), where a stand-in ``cupy`` package serves
``cupy.cuda`` and ``cupy.RawModule`` from this package and points
``kvd_protocol.cuda_driver`` at a fake libcuda. The engine (the test
process, or a spawned one) calls ``driver.install()`` and allocates its KV
tensors in fake device memory (``engine``); ``kvd_client`` runs unchanged
with ``engine.FakeCudaKVPool`` in place of the torch ``CudaKVPool``.

What is real and what is not:

- ``memory``: device memory is memfd-backed and shared across processes
  through IPC handles (CUDA IPC maps the same memory, so does this); every
  access goes through a region table, so a kernel, DMA or flag write to
  memory nobody registered, opened or kept open faults (illegal address).
- ``streams``: each stream is a worker thread running its queued work in
  order; events, cross-stream waits, host-polled completion and
  ``cuStreamWaitValue32``/``WriteValue32`` have CUDA's semantics (a wait
  blocks that stream until the word reaches the value, whoever writes it).
  ``FAKECUDA_KERNEL_DELAY_S`` makes each kernel (or the kernels named)
  hold its stream that long: the knob that keeps copies in flight or a
  stream stuck. ``FAKECUDA_FAIL_HOST_REGISTER=n`` fails the n-th
  ``cudaHostRegister`` call of the process, once (pinning that fails midway).
  ``FAKECUDA_MAX_3D_ROWS=n`` refuses pitched copy ops of more than n rows
  (a driver that refuses some ops: kvd must fall back to rows).
- ``memory`` also models CUDA virtual memory: ``cuMemCreate`` makes a memfd,
  ``cuMemMap`` maps it at a fixed address inside a reserved range,
  ``cuMemExportToShareableHandle`` dups it and ``cuMemImportFromShareableHandle``
  takes only such memfds (anything else is refused, as the driver refuses a
  descriptor that is no allocation of its own); mappings side by side in one
  reservation are one contiguous range to copies. ``engine.vmm_kv_tensors``
  lays a pool out as vLLM 0.34's extensible KV cache does.
- ``kernels``: kv_gather/kv_scatter of kernels/kv_copy.cu in numpy (layer
  subranges, the cancel word, vector width and alignment), with their
  signature checked against the real source.
- ``runtime``, ``cupy_api``, ``driver``: the CuPy runtime, CuPy objects and
  libcuda calls kvd makes, and nothing else (no other kernels, no GDS).
- ``trace``: ``FAKECUDA_TRACE=<file>`` records kernels, flag-word writes and
  IPC opens/closes for a test to check order afterwards.
- ``errors``: CUDA status codes; a fault in queued work breaks the context
  for good (every later call raises), as on a GPU, and says so on stderr.

Not modelled: timing, SM/copy-engine concurrency limits, peer access,
several contexts per process, pageable-memory copies. The real GPU tests
(tests/cuda/test_gpu_*.py) stay the judge of the hardware path.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import cupy_api, driver, errors, kernels, memory, runtime, streams, trace  # noqa: F401

SHIM = Path(__file__).resolve().parent / "shim"


def daemon_env(kernel_delay_s: float | dict = 0.0, trace_file: str | Path | None = None,
               devices: int = 1, fail_host_register: int = 0, max_3d_rows: int = 0,
               fail_row_batch: int = 0) -> dict:
    """Environment for a ``kvd serve`` on the fake GPU (``start_daemon(env=...)``);
    ``kernel_delay_s``: seconds for every kernel, or ``{kernel name: seconds}``;
    ``fail_host_register``: the n-th ``cudaHostRegister`` of the process fails (once);
    ``max_3d_rows``: pitched copy ops of more rows are refused (0: none);
    ``fail_row_batch``: the n-th ``cuMemcpyBatchAsync`` of the process is refused (once)."""
    path = [str(SHIM)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    delay = kernel_delay_s if not isinstance(kernel_delay_s, dict) else \
        ",".join(f"{k}={v}" for k, v in kernel_delay_s.items())
    env = {"PYTHONPATH": os.pathsep.join(path), "FAKECUDA_KERNEL_DELAY_S": str(delay),
           "FAKECUDA_DEVICES": str(devices), "FAKECUDA_FAIL_HOST_REGISTER": str(fail_host_register),
           "FAKECUDA_MAX_3D_ROWS": str(max_3d_rows), "FAKECUDA_FAIL_ROW_BATCH": str(fail_row_batch)}
    if trace_file is not None:
        env["FAKECUDA_TRACE"] = str(trace_file)
    return env
