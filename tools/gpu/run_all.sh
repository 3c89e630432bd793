#!/usr/bin/env bash
# Everything GPU in one go, on a machine with a CUDA GPU, torch and cupy, from the checkout:
#   OUT=/tmp/gpu bash tools/gpu/run_all.sh                 (logs under $OUT)
# 1. every GPU test (kernels in-process; daemon + engines over CUDA IPC); the run lists the
#    skips and fails on one whose reason does not match GPU_ALLOWED_SKIPS (default
#    "needs two": a second GPU); KvikIO for the GDS tests: tools/gpu/stage_gpu_tests.sh;
# 2. `kvd bench --gpu` (end-to-end offload/load vs pinned cudaMemcpy, requests in flight on
#    the pools vLLM and SGLang allocate; BENCH_ARGS adds flags, e.g.
#    "--blocking --repeat 5 --json $OUT/gpu.json --plot $OUT/gpu.png");
# 3. `kvd bench --restart` (cold vs warm restart of a RESTART_GIB host tier, default 64);
# 4. interference: the engine's GEMM and decode steps next to kvd's copies in separate
#    processes: a no-copy control, staged and straight DMA (INTERFERENCE_VARIANTS), on
#    one-allocation pools (INTERFERENCE_ARGS adds
#    flags, e.g. --mps).
# 5. snapshot: the pipelined bench on every pool kind, each its own run and log under $OUT
#    (block-outer with 16-token chunks of one page; one allocation and per-layer with
#    256-token chunks), with --json, for docs/data.
# 6. vmm: the copy speed of a pool in CUDA virtual memory lent by file descriptor (vLLM 0.34's
#    extensible KV cache) next to one ordinary allocation (vLLM's legacy pool), same run.
# GPU_STEPS picks steps (default tests,bench; e.g. GPU_STEPS=tests,restart,interference).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT" || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/clients:$PWD${PYTHONPATH:+:$PYTHONPATH}"
steps=${GPU_STEPS:-tests,bench}
rc=0
if [[ $steps == *tests* ]]; then
  echo "== pytest -m gpu"
  # a skip for any other reason (a package missing: tools/gpu/stage_gpu_tests.sh) fails the step
  timeout 570 python3 -m pytest -q -m gpu -p no:cacheprovider -rs --durations=15 \
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
if [[ $steps == *vmm* ]]; then
  echo "== kvd bench --gpu --gpu-pool one,vmm"
  timeout 300 python3 -m kvd bench --gpu --gpu-pool one,vmm --repeat 5 --json "$OUT/vmm.json" 2>&1 \
    | tee "$OUT/vmm.log" | tail -n 20
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "VMM BENCH FAILED"; rc=1; }
fi
exit $rc
