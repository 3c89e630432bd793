#!/usr/bin/env bash
# Before a GPU session, here (no GPU): does everything staged for the GPU machine import there?
# Builds (once) a Python 3.12 venv with the GPU machine's torch 2.11.0 (CUDA 13 build), CuPy 14.2
# and the image packages the project's GPU paths import, then, against the staged files:
#   1. every GPU test module of tests/cuda is imported (collected with torch pretending a GPU);
#   2. .vstage (vLLM 0.26): vLLM imports, the KvdConnector leaves no abstract method of vLLM's
#      connector base and keeps its signatures; tests/vllm's GPU modules are collected;
#   3. .vstage/lmcache (tools/gpu/stage_lmcache.sh): LMCache's extensions load on torch 2.11;
#   4. .sgstage (SGLang 0.5.16): SGLang imports, KvdHiCacheStorage leaves no abstract method;
#      tests/sglang's GPU modules are collected.
# A step whose stage is missing is skipped and says so. Catches import breakage (a module moved,
# a package not staged) for the price of a CPU minute instead of a GPU run.
#   bash tools/gpu/preflight.sh            PREFLIGHT_VENV=dir (default ~/.cache/kvd-gpu-preflight)
set -uo pipefail
repo=$(git rev-parse --show-toplevel)
cd "$repo"
V=${PREFLIGHT_VENV:-$HOME/.cache/kvd-gpu-preflight}
PY=$V/bin/python
if ! "$PY" -c 'import torch, cupy; assert torch.__version__.startswith("2.11.0")' 2>/dev/null; then
  py312=${PY312:-$(ls "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | head -1)}
  [ -x "${py312:-}" ] || { echo "preflight: need a CPython 3.12 (set PY312)" >&2; exit 2; }
  echo "preflight: building $V (torch 2.11.0 with its CUDA 13 libraries: a few GB, a few minutes)"
  "$py312" -m venv "$V" && "$PY" -m pip install -q --upgrade pip || exit 2
  # versions as on the GPU machine (the device tool's KINDS.md), the rest as the image has them
  "$PY" -m pip install -q torch==2.11.0 torchvision==0.26.0 cupy-cuda13x==14.2.0 transformers==5.17.0 \
    numpy msgpack xxhash uvloop pytest pytest-timeout pyyaml psutil requests pillow tiktoken \
    sentencepiece einops cloudpickle numba grpcio protobuf prometheus-client sortedcontainers \
    safetensors aiohttp aiofiles httpx py-cpuinfo huggingface_hub .gpu/whl/pyzmq-*.whl || exit 2
fi
rc=0
step() { echo "== $1"; }
fail() { echo "PREFLIGHT FAILED: $1"; rc=1; }
collect() {  # PYTHONPATH-extra, test files...: every module imported, none errored
  local extra=$1; shift
  out=$(PYTHONPATH="$extra:clients:.:tools/gpu" "$PY" -m pytest --collect-only -q -p pretend_gpu \
        -p no:cacheprovider "$@" 2>&1)
  echo "$out" | tail -1
  # pytest's summary line counts modules that failed to import as errors
  echo "$out" | tail -1 | grep -q -E "[0-9]+ errors?" && { echo "$out" | grep -E "^E |^ERROR" | head -20; return 1; }
  return 0
}
step "1. tests/cuda GPU modules (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
collect "" -m gpu tests/cuda/ || fail "tests/cuda"
if [ -d .vstage/site/vllm ]; then
  step "2. vLLM (.vstage)"
  VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=.vstage/site:clients:. "$PY" - <<'PYEOF' 2>&1 | grep -v -E "INFO|WARNING|W[0-9]{4}" || fail "vLLM connector"
import inspect, sys, vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from kvd_client.vllm import KvdConnector
bad = sorted(getattr(KvdConnector, "__abstractmethods__", ()))
for name, fn in inspect.getmembers(base.KVConnectorBase_V1, inspect.isfunction):
    mine = getattr(KvdConnector, name)
    if mine is not fn and list(inspect.signature(fn).parameters) != list(inspect.signature(mine).parameters):
        bad.append(f"{name}{inspect.signature(mine)} vs vLLM's {inspect.signature(fn)}")
print("vllm", vllm.__version__, "connector:", "ok" if not bad else bad)
sys.exit(1 if bad else 0)
PYEOF
  collect .vstage/site tests/vllm/test_gpu_*.py || fail "tests/vllm"
else echo "== 2. vLLM: not staged (bash ../shared/gpu/vllm/stage.sh)"; fi
if [ -d .vstage/lmcache/site/lmcache ]; then
  step "3. LMCache (.vstage/lmcache)"
  PYTHONPATH=.vstage/site:.vstage/lmcache/site "$PY" -c 'import lmcache.c_ops, lmcache.integration.vllm.lmcache_mp_connector, lmcache; print("lmcache", lmcache.__version__, "extensions load")' \
    2>&1 | tail -1 | grep "extensions load" || fail "LMCache"
else echo "== 3. LMCache: not staged (bash tools/gpu/stage_lmcache.sh)"; fi
if [ -d .sgstage/site/sglang ]; then
  step "4. SGLang (.sgstage)"
  PYTHONPATH=.sgstage/site:clients:. "$PY" -c '
import sys, sglang
from kvd_client.sglang.backend import KvdHiCacheStorage
from kvd_client.sglang.radix import KvdRadixCache  # noqa: F401 (imports on this SGLang)
left = sorted(KvdHiCacheStorage.__abstractmethods__)
print("sglang", sglang.__version__, "backend:", "ok" if not left else left); sys.exit(1 if left else 0)' 2>&1 | tail -1 \
    | grep "backend: ok" || fail "SGLang backend"
  collect .sgstage/site tests/sglang/test_gpu_*.py || fail "tests/sglang"
else echo "== 4. SGLang: not staged (bash tools/gpu/stage_sglang.sh)"; fi
[ $rc -eq 0 ] && echo "preflight: everything staged imports"
exit $rc
