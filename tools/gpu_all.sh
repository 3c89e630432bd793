#!/usr/bin/env bash
# Everything GPU in one go, on a machine with a CUDA GPU, torch and cupy, from the checkout:
#   OUT=/tmp/gpu bash tools/gpu_all.sh                 (logs under $OUT)
# 1. every GPU test (kernels in-process; daemon + engines over CUDA IPC); the run lists the
#    skips and fails on one whose reason does not match GPU_ALLOWED_SKIPS (default
#    "needs two": a second GPU); KvikIO for the GDS tests: tools/gpu/stage_gpu_tests.sh;
# 2. `kvd bench --gpu` (end-to-end offload/load vs pinned cudaMemcpy, requests in flight on
#    the pools vLLM and SGLang allocate; BENCH_ARGS adds flags, e.g.
#    "--blocking --repeat 5 --json $OUT/gpu.json --plot $OUT/gpu.png");
# 3. `kvd bench --restart` (cold vs warm restart of a RESTART_GIB host tier, default 64);
# 4. sweep: tools/ab_runs.sh with DAEMON_LOG=1, one round (the pipelined bench per
#    daemon setting, with the daemon's phases; SWEEP_VARIANTS as ab_runs.sh's VARIANTS,
#    SWEEP_ARGS its bench flags);
# 5. interference: the engine's GEMM and decode steps next to kvd's copies in separate
#    processes: a no-copy control, staged and straight DMA (INTERFERENCE_VARIANTS), on
#    one-allocation pools (INTERFERENCE_ARGS adds
#    flags, e.g. --mps).
# 6. snapshot: the pipelined bench on every pool kind, each its own run and log under $OUT
#    (block-outer with 16-token chunks of one page; one allocation and per-layer with
#    256-token chunks), with --json, for docs/data.
# 7. probe: the copy engines alone (tools/probes/dma_probe.py, no daemon) for the cases kvd's
#    snapshot misses: pages of 64 and 16 as one copy per (layer, page) (per-layer pools)
#    and as pitched ops, 1 and 8 streams (PROBE_CASES, PROBE_WAYS change them).
# GPU_STEPS picks steps (default tests,bench; e.g. GPU_STEPS=tests,sweep,interference).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT" || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/clients:$PWD${PYTHONPATH:+:$PYTHONPATH}"
steps=${GPU_STEPS:-tests,bench}
rc=0
if [[ $steps == *tests* ]]; then
  echo "== pytest -m gpu"
  # a skip for any other reason (a package missing: tools/gpu/stage_gpu_tests.sh) fails the step
  timeout 570 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
    --only-skips "${GPU_ALLOWED_SKIPS:-needs two}" tests/cuda/test_gpu_*.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 30
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "GPU TESTS FAILED"; rc=1; }
fi
if [[ $steps == *bench* ]]; then
  echo "== kvd bench --gpu"
  timeout 400 python3 -m kvd bench --gpu ${BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu_bench.log" | tail -n 20
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "GPU BENCH FAILED"; rc=1; }
fi
if [[ $steps == *restart* ]]; then
  echo "== kvd bench --restart"
  timeout 500 python3 -m kvd bench --restart --restart-gib "${RESTART_GIB:-64}" 2>&1 \
    | tee "$OUT/restart_bench.log" | tail -n 20
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "RESTART BENCH FAILED"; rc=1; }
fi
if [[ $steps == *sweep* ]]; then
  echo "== tools/ab_runs.sh (sweep)"
  # shellcheck disable=SC2086  # SWEEP_ARGS is a list of flags
  OUT="$OUT/sweep" ROUNDS=1 DAEMON_LOG=1 RUN_TIMEOUT=300 \
    VARIANTS=${SWEEP_VARIANTS:-"default|;alone1|KVD_MAX_QUEUED_COPIES_ALONE=1"} \
    timeout 400 bash tools/ab_runs.sh ${SWEEP_ARGS:---pipeline 4 --clients 2 \
    --gpu-page-sizes 16 --repeat 3 --gpu-pool one} 2>&1 | tee "$OUT/sweep.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "DMA SWEEP FAILED"; rc=1; }
fi
if [[ $steps == *interference* ]]; then
  echo "== kvd bench --gpu --interference"
  timeout 500 python3 -m kvd bench --gpu --interference --interference-workloads gemm,decode \
    --interference-variants "${INTERFERENCE_VARIANTS:-none (control);dma;dma, stores only;dma, loads only;dma, staged, stores only}" --gpu-pool one ${INTERFERENCE_ARGS:-} 2>&1 \
    | tee "$OUT/interference.log" | tail -n 25
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "INTERFERENCE BENCH FAILED"; rc=1; }
fi
if [[ $steps == *snapshot* ]]; then
  snap=(
    "block-outer|--gpu-pool block-outer --chunk-tokens 16 --chunks 128 --gpu-page-sizes 16 --pipeline-rounds 16"
    "one|--gpu-pool one --gpu-page-sizes 1,16,64 --pipeline-rounds 8"
    "per-layer|--gpu-pool per-layer --gpu-page-sizes 64 --pipeline-rounds 8")
  for entry in "${snap[@]}"; do
    name=${entry%%|*}
    echo "== snapshot $name: kvd bench --gpu --pipeline 4 --clients 2 --repeat 5 ${entry#*|}"
    # shellcheck disable=SC2086  # the entry's flags are a list
    timeout 200 python3 -m kvd bench --gpu --pipeline 4 --clients 2 --repeat 5 ${entry#*|} \
      --json "$OUT/snapshot-$name.json" 2>&1 | tee "$OUT/snapshot-$name.log" | sed -n '/^pipelined/,$p'
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "SNAPSHOT $name FAILED"; rc=1; }
  done
fi
if [[ $steps == *probe* ]]; then
  echo "== tools/probes/dma_probe.py"
  timeout 300 python3 tools/probes/dma_probe.py --reps 5 --cases "${PROBE_CASES:-mla:64,llama:64,mla:16,llama:16}" \
    --ways "${PROBE_WAYS:-1d,3d}" --streams 1,8 2>"$OUT/probe.err" | tee "$OUT/probe.jsonl" \
    | grep -v '^{"gpu"'
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "PROBE FAILED"; tail -n 5 "$OUT/probe.err"; rc=1; }
fi
exit $rc
