#!/usr/bin/env bash
# GPU machine, a later run with nothing carried: runs "$@" from the repository root with the vLLM
# 0.26 that an earlier run's .vstage/cur1/call1.sh and .vstage/cur2/call2.sh unpacked into
# /tmp/vsite (the same environment as call2.sh). Exits 42 saying MACHINE LOST when /tmp/vsite
# lacks vLLM or its _C extension (the machine went back between runs): make both runs again.
#
#   bash tools/gpu/v026_run.sh python3 examples/fleet.py --arms native,none ...
set -u
cd "$(dirname "$0")/../.."
D=/tmp/vsite
ls $D/vllm/__init__.py $D/vllm/_C*.so >/dev/null 2>&1 ||
  { echo "MACHINE LOST: /tmp/vsite lacks vLLM or its _C; run call1.sh, then call2.sh, back to back"; exit 42; }
. tools/gpu/vllm_env.sh  # (the cd above: the checkout root)
"$@"
