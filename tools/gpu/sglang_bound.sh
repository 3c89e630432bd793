#!/usr/bin/env bash
# GPU machine: SGLang (>= 0.5.23, the linker) against the copy bound, in steps that each fit one
# run of at most 600 s on one warm machine (docs/sglang.md, "Measured"). Run through the stage's
# call2.sh, which makes SGLang and this checkout importable:
#
#   bash .sg023stage/cur1/call2.sh bash tools/gpu/sglang_bound.sh ttft-kvd      # the first run
#   bash tools/gpu/sglang_bound.sh ttft-base       # later runs, nothing carried: without SGLang
#   bash tools/gpu/sglang_bound.sh load            #   importable the script goes through
#   bash tools/gpu/sglang_bound.sh staging         #   sglang_call2.sh (SGSITE: /tmp/sg023site)
#   bash tools/gpu/sglang_bound.sh load-tree       # (and gpu-test, load-why)
#
# ttft-kvd: a storing engine, then a fresh one with the linker: a kvd hit at each length, traced;
# ttft-base: full prefill, suffix alone, the bound's floor and SGLang's own host-tier hit, merged
# with ttft-kvd's report into one table; load: throughput without kvd and with the linker (no hit);
# load-tree: the same with SGLang's Python radix tree core (which the linker needs) on both sides;
# load-why: load-tree with kvd's calls traced, then the linker storing nothing;
# gpu-test: the linker's GPU test, layer-wise loads into SGLang's GPU pools byte for byte;
# staging: the daemon's copy into SGLang's host pools against a memcpy on this machine's cores, the
# daemon on 4 copy threads and on 16 (COPY_THREADS: the values; 0 is the daemon's default, a thread
# per CPU up to 16).
# Reports and logs go to $OUT (and /tmp/kvd-sglang-bound, where a later step finds the earlier).
set -u
step=${1:?"a step: ttft-kvd, ttft-base, load, load-tree, load-why, gpu-test or staging"}
here=$(cd "$(dirname "$0")/../.." && pwd)
keep=/tmp/kvd-sglang-bound OUT=${OUT:-$keep}
mkdir -p "$keep" "$OUT"
# a later run: through sglang_call2.sh, which stops before running us when SGLang does not import
if ! python3 -c 'import sglang' 2>/dev/null; then
  export SGSITE=${SGSITE:-/tmp/sg023site}
  exec bash "$here/tools/gpu/sglang_call2.sh" bash "$here/tools/gpu/sglang_bound.sh" "$@"
fi
cd "$here" || exit 1
PREFIXES=${PREFIXES:-2048,8192,16384,32768} REPEAT=${REPEAT:-5}
common=(--prefixes "$PREFIXES" --repeat "$REPEAT" --attention-backend "${ATTENTION:-triton}")

run() {  # name, seconds, command...: its output in $OUT/name.log, the tail shown
  local name=$1 limit=$2; shift 2
  echo "[$step] $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "Ignore import error\|is deprecated" "$OUT/$name.log" | tail -40
  echo "[$step] $name: exit $rc"
  return $rc
}

case $step in
  ttft-kvd)
    run ttft_kvd 560 python3 examples/sglang_ttft.py "${common[@]}" --host-pools linker --no-full \
      --trace --out "$keep/ttft_kvd.json"
    cp "$keep/ttft_kvd.json" "$OUT/" ;;
  ttft-base)
    [ -f "$keep/ttft_kvd.json" ] || {
      echo "MACHINE LOST: $keep/ttft_kvd.json is gone; run ttft-kvd first"; exit 42; }
    run ttft 560 python3 examples/sglang_ttft.py "${common[@]}" --host-pools '' --host-hit \
      --merge "$keep/ttft_kvd.json" --out "$OUT/sglang_ttft.json" ;;
  gpu-test)  # the linker's GPU test (tests/sglang/test_gpu_linker.py): byte-exact layer-wise loads
    run gpu_test 300 python3 -m pytest -q -rs -m gpu tests/sglang/test_gpu_linker.py ;;
  load)
    run load 560 python3 examples/sglang_load.py --roles none,linker --out "$OUT/sglang_load.json" ;;
  load-why)  # where the linker's time under load goes: its calls traced beside the Python-tree engine,
    # then the linker storing nothing (kvd_offload false); LOAD_REPEAT timed runs each (default 2)
    run load_trace 220 python3 examples/sglang_load.py --roles none-pytree,linker --trace \
      --repeat "${LOAD_REPEAT:-2}" --out "$OUT/sglang_load_trace.json"
    run load_ro 120 python3 examples/sglang_load.py --roles linker --trace --extra '{"kvd_offload": false}' \
      --repeat "${LOAD_REPEAT:-2}" --out "$OUT/sglang_load_ro.json" ;;
  load-tree)  # the linker beside the same engine on SGLang's Python radix tree core, without kvd
    run load_tree 560 python3 examples/sglang_load.py --roles none-pytree,linker \
      --out "$OUT/sglang_load_tree.json" ;;
  staging)  # per daemon copy_threads value a daemon of its own (its arena leaves /dev/shm with
    # it), then both host-pool modes: the daemon's copy on 4 of the cores and on 16
    for threads in ${COPY_THREADS:-4 16}; do
      rd=$keep/staging-run-$threads
      python3 -m kvd serve --runtime-dir "$rd" --chunk-tokens 64 --host-capacity 4GiB --warm-restart false \
        --copy-threads "$threads" > "$OUT/staging_kvd_$threads.log" 2>&1 &
      daemon=$!
      trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null' EXIT
      for _ in $(seq 100); do
        python3 -m kvd health --runtime-dir "$rd" --timeout 0.5 >/dev/null 2>&1 && break; sleep 0.2
      done
      run "staging_t$threads" 200 python3 tests/sglang/bench_staging.py --runtime-dir "$rd" --host-pool staging
      run "shared_t$threads" 140 python3 tests/sglang/bench_staging.py --runtime-dir "$rd" --host-pool shared
      kill $daemon; wait $daemon 2>/dev/null
    done ;;
  *) echo "unknown step $step: ttft-kvd, ttft-base, load, load-tree, load-why, gpu-test or staging"; exit 2 ;;
esac
