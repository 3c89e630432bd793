"""kvd's UnifiedCacheLinker on a GPU: SGLang's GPU KV pool registered by CUDA IPC, layer-wise loads.

Needs a CUDA GPU and SGLang ≥ 0.5.23 (the ``UnifiedCacheLinker`` interface)
importable by this python with a CUDA torch; skipped otherwise (SGLang 0.5.23
pins torch 2.14, which the GPU machine lacks today). The worker
(linker_worker.py, this python) builds SGLang's ``MHATokenToKVPool`` /
``MLATokenToKVPool`` and paged allocator on ``cuda`` and the plain
``KvdLinker`` through SGLang's ``create_unified_cache_linker``; ``kvd serve
--gpu on`` copies with its copy engines straight into SGLang's GPU pages:

- engine A offloads pages it filled (the daemon copies after A's stream
  reached the offload), engine B (another device pool, poisoned slots)
  finds them with one lookup and loads them layer by layer: every layer is
  read through SGLang's ``get_key_buffer``, whose ``wait_until`` makes B's
  stream wait for that layer; the bytes equal A's, K and V, every layer.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("no SGLang in this python", allow_module_level=True)
try:
    _linker = importlib.util.find_spec("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
except ModuleNotFoundError:  # a parent package is missing: an older SGLang
    _linker = None
if _linker is None:
    pytest.skip("SGLang older than 0.5.23: no UnifiedCacheLinker", allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from test_hicache import Worker  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture
def lw(tmp_path):
    w = Worker(sys.executable, tmp_path / "worker.log", HERE / "linker_worker.py")
    yield w
    w.close()


@pytest.mark.parametrize("mla", [False, True])
def test_a_hit_lands_in_sglangs_gpu_pages_layer_by_layer_byte_for_byte(start_daemon, lw, mla):
    daemon = start_daemon(gpu="on", chunk_tokens=16, host_capacity="256MiB")
    extra = {"kvd_runtime_dir": str(daemon.runtime_dir)}
    shape = dict(mla=mla, layers=4, heads=8, dim=128, pages=256, device="cuda", kvd_linker=True)
    lw("engine", name="a", extra=extra, **shape)
    lw("engine", name="b", extra=extra, **shape)
    toks = list(range(100, 100 + 64 * 16))
    keys = lw("hash", name="a", tokens=toks)
    stored = lw("offload", name="a", keys=keys, seed=7)
    assert stored["queued"] and stored["ok"], lw("stats", name="a")
    assert lw("lookup", name="b", keys=lw("hash", name="b", tokens=toks)) == list(range(1, 65))
    got = lw("load", name="b", keys=keys, rid="gpu")
    assert got["landed"], lw("stats", name="b")
    assert got["pages"] == stored["pages"]
    for name in ("a", "b"):
        stats = lw("stats", name=name)
        assert stats["registered"] and stats["refused"] is None
        lw("close", name=name)
