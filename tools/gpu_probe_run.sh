#!/usr/bin/env bash
# Diagnostic run on the GPU machine (logs under $OUT):
#   bash .gpu/run.sh bash tools/gpu_probe_run.sh
# probe (tools/gpu_path_probe.py), GPU tests, then the bench with a debug daemon log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/clients:$PWD${PYTHONPATH:+:$PYTHONPATH}"
df -h /dev/shm | tail -1
if [[ ${PROBE_PARTS:-x} != none ]]; then
  echo "== probe"
  timeout ${PROBE_TIMEOUT:-150} python3 tools/gpu_path_probe.py --out "$OUT/probe.json" ${PROBE_PARTS:+--parts $PROBE_PARTS} \
    >"$OUT/probe.log" 2>&1; echo "probe rc $?"
  grep -v '^{' "$OUT/probe.log" | tail -n 30
fi
if [[ ${RUN_TESTS:-1} == 1 ]]; then
  echo "== pytest -m gpu"
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x -m gpu -p no:cacheprovider -rs tests/test_gpu_kernels.py tests/test_gpu_ipc.py \
    >"$OUT/gpu_tests.log" 2>&1; echo "tests rc $?"
  tail -n 25 "$OUT/gpu_tests.log"
fi
echo "== bench (debug daemon)"
timeout ${BENCH_TIMEOUT:-150} python3 tools/bench_debug.py "$OUT/daemon.log" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1; echo "bench rc $?"
tail -n 16 "$OUT/bench.log"
