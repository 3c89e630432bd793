#!/usr/bin/env bash
# GPU check of kvd's copy kernels; run on a machine with a CUDA GPU, nvcc, torch
# and cupy, from anywhere in the checkout:
#   bash tools/gpu/test_kernels.sh
# 1. nvcc builds kernels/kv_copy.cu for sm_80 and sm_90 with warnings as
#    errors (resource report and 128-bit access count in $OUT/nvcc.log);
# 2. the GPU tests (tests/cuda/test_gpu_kernels.py), isolated from the repo's
#    pytest config;
# 3. a short compute-sanitizer memcheck pass over a few test cases.
# Logs go to $OUT (a temporary folder when OUT is unset). Exit status is
# non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTEST=(python3 -m pytest -p no:cacheprovider -c /dev/null --rootdir=. --noconftest
        -o markers=gpu -m gpu)
rc=0

echo "== nvcc" | tee "$OUT/nvcc.log"
for arch in sm_80 sm_90; do
  nvcc -arch=$arch --cubin -Xptxas -v -Werror all-warnings -o "$OUT/kv_copy_$arch.cubin" \
    kernels/kv_copy.cu >>"$OUT/nvcc.log" 2>&1 || { echo "nvcc $arch FAILED"; rc=1; }
done
if command -v cuobjdump >/dev/null; then
  cuobjdump -sass "$OUT/kv_copy_sm_90.cubin" >"$OUT/kv_copy_sm_90.sass" 2>&1
  echo "128-bit global loads/stores in sm_90 SASS: $(grep -cE '(LDG|STG)\.E\.(EF\.)?128' "$OUT/kv_copy_sm_90.sass")" \
    | tee -a "$OUT/nvcc.log"
fi
grep -E "Used|warning|error" "$OUT/nvcc.log"
rm -f "$OUT"/*.cubin

echo "== pytest"
"${PYTEST[@]}" -q -rs tests/cuda/test_gpu_kernels.py 2>&1 | tee "$OUT/pytest.log" | tail -n 25
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "pytest FAILED"; rc=1; }

echo "== compute-sanitizer (subset)"
if command -v compute-sanitizer >/dev/null; then
  timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "${PYTEST[@]}" -q -x \
    -k "ps16 and mis0 and (vllm_flash_attn or sglang_mla) or ps1-odd5-mis1 or reuse or device_side" \
    tests/cuda/test_gpu_kernels.py >"$OUT/sanitizer.log" 2>&1
  s=$?
  tail -n 5 "$OUT/sanitizer.log"
  [ $s -eq 0 ] || { echo "compute-sanitizer exit $s"; rc=1; }
fi

echo "test_kernels exit $rc"
exit $rc
