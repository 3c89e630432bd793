#!/usr/bin/env bash
# GPU machine: runs "$@" from the repository root with vLLM 0.34 (unpacked into /tmp/v034site
# by the pieces of tools/gpu/stage_vllm034.sh) and this checkout importable. Exits 42 saying
# MACHINE LOST when /tmp/v034site is missing or incomplete (the machine went back between
# runs): unpack all pieces again, from 01.
#
#   bash tools/gpu/v034_run.sh python3 tools/your_vllm_script.py
#   (or append it to the last piece's run: bash .v034stage/pieces/NN/v034_piece.sh && bash tools/gpu/v034_run.sh ...)
set -u
cd "$(dirname "$0")/../.."
D=/tmp/v034site
[ -f $D/.v034/complete ] && [ -f $D/vllm/__init__.py ] ||
  { echo "MACHINE LOST: $D missing or incomplete; unpack the pieces again from 01, back to back"; exit 42; }
. tools/gpu/vllm_env.sh  # (the cd above: the checkout root)
"$@"
