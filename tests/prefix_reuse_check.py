"""The transformers side of examples/prefix_reuse.py, without kvd or a GPU: a script.

``python tests/prefix_reuse_check.py`` (a python with torch and transformers:
the GPU machine's, or in CI the vLLM venv's, which has no pytest) checks that
a prefix's KV written into a paged pool (random page order) and rebuilt
lazily layer by layer gives the full prefill's logits, that every layer's
hook ran in order and was removed, and that one flipped byte in the pool
fails that check; prints ``ok`` last, or exits non-zero with the assertion.
Run by tests/cuda/test_gpu_e2e.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import prefix_reuse as pr  # noqa: E402

TINY_ARGS = ["--tiny", "--layers", "2", "--prefix-lens", "512", "--suffix", "32", "--repeat", "1",
             "--chunk-tokens", "256", "--page-size", "16"]


def check() -> None:
    import torch
    args = pr.parse_args(TINY_ARGS)
    shape = pr.model_shape(args)
    model = pr.build_model(shape, "cpu")
    p = pr.prompts(args)[0]
    n, ps = len(p["prefix"]), args.page_size
    pool = [torch.zeros(2, 2 * n // ps, ps, shape["num_key_value_heads"], shape["head_dim"],
                        dtype=torch.bfloat16) for _ in range(shape["num_hidden_layers"])]
    pages = torch.randperm(2 * n // ps)[: n // ps]
    ids = torch.from_numpy(np.concatenate([p["prefix"], p["suffix"]])).unsqueeze(0)
    suffix = torch.from_numpy(p["suffix"]).unsqueeze(0)
    _, cache = pr.full_prefill(model, ids[:, :n])
    pr.cache_to_pool(cache, pool, pages, n)
    ref, _ = pr.full_prefill(model, ids)
    order = []
    got = pr.prefill_from_pool(model, pool, pages, n, suffix, order.append)
    assert order == list(range(shape["num_hidden_layers"])), order
    assert pr.check_logits(got, ref, args.rtol)["ok"], pr.check_logits(got, ref, args.rtol)
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)
    tok = n // 2
    pr.corrupt_byte(pool, int(pages[tok // ps]), tok % ps)
    bad = pr.prefill_from_pool(model, pool, pages, n, suffix)
    assert not pr.check_logits(bad, ref, args.rtol)["ok"], "a flipped byte went unnoticed"


if __name__ == "__main__":
    check()
    print("ok")
