"""Fixtures of the fake-GPU tests (tests/cuda/test_fake_gpu_*.py; the fake: tests/fakecuda).

``fake_engine``: this test process as an engine on the fake GPU: the fake
libcuda is installed into ``kvd_protocol.cuda_driver`` for the test only (and
taken out after it, so the real GPU tests of the same session get the real
driver), ``tensors(...)`` allocates KV tensors in fake device memory (freed
after the test), ``pool(...)`` wraps them in a ``FakeCudaKVPool`` on the
engine's stream. A fault of the engine's fake context fails the test.

``fake_daemon(kernel_delay_s=..., trace=True, **knobs)``: a real ``kvd serve
--gpu on`` whose ``cupy`` is the fake (``fakecuda.daemon_env``); ``.trace()``
reads what its fake GPU did (fakecuda.trace). A daemon whose fake context
broke fails the test.
"""

from __future__ import annotations

from pathlib import Path

import fakecuda  # tests/fakecuda (tests/ is on the path, as for workers_*.py)
import pytest
from fakecuda import engine, errors
from fakecuda.memory import SPACE

BROKEN = "fakecuda: context broken"


class FakeEngine:
    def __init__(self) -> None:
        self.stream = fakecuda.streams.Stream(name="engine")
        self.regions = []

    def tensors(self, layout: str, layers: int, pages: int, page_size: int, heads: int, dim: int,
                seed: int = 0):
        tensors, flat, region = engine.kv_tensors(layout, layers, pages, page_size, heads, dim, seed)
        self.regions.append(region)
        return tensors, flat, region

    def pool(self, layout: str, tensors, page_size: int | None = None) -> engine.FakeCudaKVPool:
        return engine.FakeCudaKVPool(layout, tensors, page_size, stream=self.stream)


@pytest.fixture
def fake_engine():
    restore = fakecuda.driver.install()
    eng = FakeEngine()
    try:
        yield eng
        assert eng.stream.synchronize(timeout=30), "the engine's stream is stuck"
    finally:
        restore()
        for region in eng.regions:
            SPACE.free(region.base)
        broken = errors.reset()
    assert broken is None, f"the engine's fake GPU context broke: {broken}"


class FakeGpuDaemon:
    def __init__(self, proc, trace_file: Path | None) -> None:
        self.proc, self.trace_file = proc, trace_file

    def trace(self) -> list[dict]:
        return fakecuda.trace.read(self.trace_file) if self.trace_file else []

    def __getattr__(self, name):
        return getattr(self.proc, name)


@pytest.fixture
def fake_daemon(start_daemon, tmp_path):
    started = []

    def start(kernel_delay_s: float | dict = 0.0, trace: bool = False, fail_host_register: int = 0,
              max_3d_rows: int = 0, fail_row_batch: int = 0, **knobs) -> FakeGpuDaemon:
        trace_file = tmp_path / f"trace{len(started)}.jsonl" if trace else None
        env = fakecuda.daemon_env(kernel_delay_s, trace_file, fail_host_register=fail_host_register,
                                  max_3d_rows=max_3d_rows, fail_row_batch=fail_row_batch)
        d = FakeGpuDaemon(start_daemon(env=env, gpu="on", **knobs), trace_file)
        started.append(d)
        return d

    yield start
    for d in started:
        assert BROKEN not in d.log(), d.log()
