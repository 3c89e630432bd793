#!/usr/bin/env bash
# GPU machine, a later run with nothing carried: runs "$@" from the repository root with the vLLM
# 0.26 that an earlier run's .vstage/cur1/call1.sh and .vstage/cur2/call2.sh unpacked into
# /tmp/vsite (the same environment as call2.sh). Exits 42 saying MACHINE LOST when /tmp/vsite
# lacks vLLM or its _C extension (the machine went back between runs): make both runs again.
#
#   bash tools/gpu/v026_run.sh python3 examples/fleet.py --arms native,none ...
set -u
cd "$(dirname "$0")/../.."
ls /tmp/vsite/vllm/__init__.py /tmp/vsite/vllm/_C*.so >/dev/null 2>&1 ||
  { echo "MACHINE LOST: /tmp/vsite lacks vLLM or its _C; run call1.sh, then call2.sh, back to back"; exit 42; }
export PYTHONPATH=/tmp/vsite:$PWD/clients:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# vLLM 0.26's default (V2) model runner imports flashinfer for its sampler unless this is 0;
# flashinfer is not staged.
export VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
"$@"
