#!/usr/bin/env bash
# The pipelined GPU bench once per daemon setting, to see which knob moves DMA loads
# (issue 11). On the GPU machine:
#   bash .gpu/run.sh bash tools/dma_sweep.sh
# VARIANTS: ';'-separated, each a space-separated list of KVD_<KNOB>=value for the
# daemon ("default" = none). BENCH_ARGS replaces the bench flags. Each variant's
# pipelined table, the daemon's per-copy timing medians and its phases
# (tools/daemon_timings.py --phases) go to stdout; full logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/clients:$PWD${PYTHONPATH:+:$PYTHONPATH}"
VARIANTS=${VARIANTS:-default;KVD_MAX_QUEUED_COPIES_ALONE=1}
ARGS=${BENCH_ARGS:---pipeline 4 --clients 2 --gpu-page-sizes 16 --repeat 3 --gpu-pool one}
rc=0
IFS=';' read -ra list <<< "$VARIANTS"
for k in "${!list[@]}"; do
  v=${list[$k]}
  echo "== variant $k: $v"
  log="$OUT/daemon_$k.log"
  env_args=()
  [ "$v" = default ] || read -ra env_args <<< "$v"
  env "${env_args[@]}" timeout 300 python3 -m kvd bench --gpu $ARGS --daemon-log "$log" \
    > "$OUT/bench_$k.log" 2>&1 || { echo "BENCH FAILED ($v)"; tail -n 20 "$OUT/bench_$k.log"; rc=1; }
  sed -n '/^pipelined/,$p' "$OUT/bench_$k.log"
  python3 tools/daemon_timings.py "$log" --phases | sed -n '/^daemon-side/,$p'
done
exit $rc
