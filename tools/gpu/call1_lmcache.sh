#!/usr/bin/env bash
# GPU machine, in run 1 after vLLM's call1.sh (carry [".vstage/cur1"]; tools/gpu/stage_lmcache.sh
# put it there): unpacks the staged LMCache (partL.tar.xz beside this script) into /tmp/vsite,
# where call2.sh puts vLLM on PYTHONPATH.
set -u
SECONDS=0
here=$(cd "$(dirname "$0")" && pwd)
[ -f /tmp/vsite/vllm/__init__.py ] || { echo "call1_lmcache: run vLLM's call1.sh first (no /tmp/vsite/vllm)"; exit 42; }
if command -v xz >/dev/null; then xz -dc -T0 "$here/partL.tar.xz" | tar -x -C /tmp/vsite
else python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/tmp/vsite')" "$here/partL.tar.xz"; fi
echo "LMCache unpacked in $SECONDS s: $(python3 -c 'import sys; sys.path.insert(0, "/tmp/vsite"); import lmcache; print(lmcache.__version__)' 2>&1 | tail -1)"
