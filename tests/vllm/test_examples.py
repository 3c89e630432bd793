"""The examples that say they run on CPU, run on CPU at their smallest size: examples/vllm_ttft.py
--tiny (vLLM CPU engines from the vLLM venv, a private daemon from this python). Figures are
not checked (a benchmark, not a timed test): the run ends with exit status 0 and its table has
a row with a kvd column."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVD_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600),
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: "
                                 "`make setup-vllm` builds it (make test does), or set KVD_VLLM_PYTHON")]


def test_vllm_ttft_tiny_runs_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(PYTHONPATH=f"{ROOT / 'clients'}{os.pathsep}{ROOT}", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1",
               OMP_NUM_THREADS="2")
    out_json = tmp_path / "ttft.json"
    proc = subprocess.run([str(VLLM_PYTHON), str(ROOT / "examples" / "vllm_ttft.py"), "--tiny",
                           "--prefixes", "512", "--repeat", "1", "--suffix", "64", "--host-capacity",
                           "256MiB", "--daemon-python", sys.executable, "--out", str(out_json)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^ +512 +[\d.]+ .* [\d.]+x +[\d.]+x$", proc.stdout, re.M), proc.stdout[-3000:]
    assert out_json.exists()
