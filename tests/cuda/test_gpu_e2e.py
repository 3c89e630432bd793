"""End to end with a real transformer: examples/prefix_reuse.py with a tiny Llama.

The GPU test runs the whole example (a private ``kvd serve --gpu on``,
engine A storing prefixes, engine B loading them layer by layer into its
own pool) and checks that B's next-token logits through kvd match a full
recompute, and that a prompt whose stored chunk has one flipped byte fails
that check. The CPU test checks the transformers side alone (pool layout,
lazily built cache, hooks) without kvd. Skipped without torch and
transformers (and, for the GPU test, cupy and a GPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import prefix_reuse as pr  # noqa: E402

TINY_ARGS = ["--tiny", "--layers", "2", "--prefix-lens", "512", "--suffix", "32", "--repeat", "1",
             "--chunk-tokens", "256", "--page-size", "16"]


def _gpu_ready() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_cache_from_pool_matches_full_prefill_cpu():
    """Prefix KV -> paged pool -> lazily rebuilt cache gives the full prefill's logits."""
    args = pr.parse_args(TINY_ARGS)
    shape = pr.model_shape(args)
    model = pr.build_model(shape, "cpu")
    p = pr.prompts(args)[0]
    n, ps = len(p["prefix"]), args.page_size
    pool = [torch.zeros(2, 2 * n // ps, ps, shape["num_key_value_heads"], shape["head_dim"],
                        dtype=torch.bfloat16) for _ in range(shape["num_hidden_layers"])]
    pages = torch.randperm(2 * n // ps)[: n // ps]
    ids = torch.from_numpy(np.concatenate([p["prefix"], p["suffix"]])).unsqueeze(0)
    _, cache = pr.full_prefill(model, ids[:, :n])
    pr.cache_to_pool(cache, pool, pages, n)
    ref, _ = pr.full_prefill(model, ids)
    order = []
    got = pr.prefill_from_pool(model, pool, pages, n, torch.from_numpy(p["suffix"]).unsqueeze(0), order.append)
    assert order == list(range(shape["num_hidden_layers"]))
    assert pr.check_logits(got, ref, args.rtol)["ok"]
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)
    tok = n // 2
    pr.corrupt_byte(pool, int(pages[tok // ps]), tok % ps)
    bad = pr.prefill_from_pool(model, pool, pages, n, torch.from_numpy(p["suffix"]).unsqueeze(0))
    assert not pr.check_logits(bad, ref, args.rtol)["ok"]


@pytest.mark.gpu
@pytest.mark.timeout(240)
@pytest.mark.skipif(not _gpu_ready(), reason="needs cupy and a CUDA GPU")
def test_prefix_reuse_same_logits_and_corruption_caught(tmp_path):
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
