"""End to end with a real transformer: examples/prefix_reuse.py with a tiny Llama.

The GPU test runs the whole example (a private ``kvd serve --gpu on``,
engine A storing prefixes, engine B loading them layer by layer into its
own pool) and checks that B's next-token logits through kvd match a full
recompute, and that a prompt whose stored chunk has one flipped byte fails
that check. The CPU test checks the transformers side alone (pool layout,
lazily built cache, hooks) without kvd: tests/prefix_reuse_check.py, in
this python where it has torch and transformers, else in the vLLM venv's
(CI); skipped without either. The GPU test needs cupy and a GPU too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "prefix_reuse_check.py"
VLLM_PYTHON = Path(os.environ.get("KVD_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
HAS_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def _gpu_ready() -> bool:
    if not HAS_TORCH or importlib.util.find_spec("cupy") is None:
        return False
    import torch
    return torch.cuda.is_available()


def test_cache_from_pool_matches_full_prefill_cpu():
    """tests/prefix_reuse_check.py in this python where it has torch and transformers, else
    in the vLLM venv's (CI: `make test` builds it)."""
    python = Path(sys.executable) if HAS_TORCH else VLLM_PYTHON
    if not python.exists():
        pytest.skip(f"no torch and transformers here and no vLLM venv at {VLLM_PYTHON}")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'clients'}{os.pathsep}{ROOT}",
           "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(python), str(CHECK)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.timeout(240)
@pytest.mark.skipif(not _gpu_ready(), reason="needs torch, transformers, cupy and a CUDA GPU")
def test_prefix_reuse_same_logits_and_corruption_caught(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    import prefix_reuse as pr
    from prefix_reuse_check import TINY_ARGS
    out = tmp_path / "e2e.json"
    args = pr.parse_args([*TINY_ARGS, "--corrupt", "--timeout", "200", "--out", str(out)])
    result = pr.run(args)
    pr.report(result)
    clean = [r for r in result["rows"] if not r["corrupt"]]
    corrupt = [r for r in result["rows"] if r["corrupt"]]
    assert len(clean) == 1 and len(corrupt) == 1
    for r in clean:
        assert r["logits"]["ok"], r["logits"]
        assert r["kvd_ms"] > 0 and r["full_ms"] > 0
    assert not corrupt[0]["logits"]["ok"], corrupt[0]["logits"]
    assert result["clean_ok"] and result["corrupt_caught"]
    assert json.loads(out.read_text())["rows"][0]["prefix"] == 512
