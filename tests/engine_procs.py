"""Engine processes of the GPU end-to-end tests (tests/vllm/test_gpu_engine.py,
tests/sglang/test_gpu_server.py): their results, and how their logprobs compare.

``result((proc, out, log), timeout)`` waits for an engine process (killed and
reaped past ``timeout``), asserts it exited 0 (the message holds the end of its
log) and returns the JSON it wrote to ``out``; with ``KVD_TEST_LOG_DIR`` set the
log and the result are copied there as well (on a GPU machine they come back).
``top_diff(a, b)`` is the largest logprob difference over ``a``'s five likeliest
tokens (a token absent from ``b``: infinity).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def result(run: tuple, timeout: float) -> dict:
    proc, out, log = run
    try:
        rc = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _keep(out, log)
    assert rc == 0, f"engine exited {rc}:\n{log.read_text()[-8000:]}"
    return json.loads(out.read_text())


def _keep(out: Path, log: Path) -> None:
    keep = os.environ.get("KVD_TEST_LOG_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / log.name).write_bytes(log.read_bytes()[-200_000:])
        if out.exists():
            (Path(keep) / out.name).write_bytes(out.read_bytes())


def top_diff(a: dict, b: dict) -> float:
    best = sorted(a, key=a.get, reverse=True)[:5]
    return max(abs(a[t] - b[t]) if t in b else float("inf") for t in best)
