#!/usr/bin/env bash
# GPU machine, the last run, which runs SGLang (carry [".sgstage/curN"]; a run alone
# when everything fits one): unpacks the parts beside it (call1.sh), checks that every
# staged part is in $SGSITE (stage.env beside it, else the environment, else /tmp/sgsite;
# exits 42 saying MACHINE LOST when an earlier run's files are gone: make every run again,
# back to back), makes SGLang (0.5.16; 0.5.23 over the vLLM 0.34 pieces' site, which its
# .sgparts/base names) and this checkout importable, then runs "$@" from the repository root.
#
#   bash .sgstage/cur1/call2.sh python3 -m pytest -q -rs tests/sglang/test_gpu_server.py
#   bash tools/gpu/sglang_call2.sh python3 examples/sglang_ttft.py   # a later run, nothing carried
#   SGSITE=/tmp/sg023site bash tools/gpu/sglang_call2.sh ...         # the same, SGLang 0.5.23
set -u
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$here/stage.env" ] && . "$here/stage.env"
export SGSITE=${SGSITE:-/tmp/sgsite}  # where call1.sh unpacks (stage.env, else the environment)
unpack=$here/call1.sh; [ -f "$unpack" ] || unpack=$here/sglang_call1.sh  # .sgstage/curN, or tools/gpu
bash "$unpack"
for p in $(cat "$SGSITE/.sgparts/expected" 2>/dev/null || echo partA); do
  [ -f "$SGSITE/.sgparts/$p" ] || { echo "MACHINE LOST: $SGSITE lacks $p; make every run again, back to back"; exit 42; }
done
# an overlay (SGLang 0.5.23) names the site it lies over: vLLM 0.34's torch 2.14, unpacked by its pieces
base=$(cat "$SGSITE/.sgparts/base" 2>/dev/null || true)
if [ -n "$base" ]; then
  [ -f "$base/.v034/complete" ] || { echo "MACHINE LOST: $base is missing or incomplete; unpack the vLLM 0.34 pieces, then these runs, back to back"; exit 42; }
  base=$base:
fi
export PYTHONPATH=$SGSITE:$base$PWD/clients:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1
# SGLang 0.5.16 JIT-compiles its CUDA kernels (nvcc, through tvm-ffi) and Triton's at first use:
# their caches live beside the site, so a later run on the same machine reuses them
export TVM_FFI_CACHE_DIR=$SGSITE/.cache/tvm-ffi TRITON_CACHE_DIR=$SGSITE/.cache/triton
# flashinfer is staged without its JIT sources: let SGLang take its other paths (it still imports it)
export SGLANG_IS_FLASHINFER_AVAILABLE=false
# headers that a staged site's JIT builds need and its pruned torch lacks (0.5.23's page hash: pybind11)
[ -d "$SGSITE/.include" ] && export CPLUS_INCLUDE_PATH=$SGSITE/.include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVD_TEST_LOG_DIR=${KVD_TEST_LOG_DIR:-${OUT:-/tmp}/logs}
python3 -c 'import sglang, sgl_kernel, torch; print("sglang", sglang.__version__, "torch", torch.__version__,
  torch.cuda.get_device_name())' || exit 1
# what the JIT builds comes back (partJ under $OUT, at most 15 MiB): staged beside the other parts,
# the next machine loads it instead of compiling (tvm-ffi loads a cached .so by name, Triton by key)
jit_files() { (cd "$SGSITE" && { find .cache/tvm-ffi -name '*.so'; find .cache/triton -type f; } 2>/dev/null | sort); }
built=$(jit_files | md5sum)
"$@"; rc=$?
if [ -n "${OUT:-}" ] && [ "$(jit_files | md5sum)" != "$built" ]; then
  mkdir -p "$SGSITE/.sgparts" && touch "$SGSITE/.sgparts/partJ"
  for only in "" tvm-ffi; do  # Triton's too where they fit, else tvm-ffi's alone
    { jit_files | grep "${only:-.}"; echo ./.sgparts/partJ; } | tar -C "$SGSITE" --owner=0 --group=0 -cf - -T - \
      | xz -6 -T0 > "$OUT/partJ.tar.xz"
    [ "$(stat -c %s "$OUT/partJ.tar.xz")" -le $((15 << 20)) ] && break
  done
  echo "JIT caches: $(jit_files | wc -l) files, \$OUT/partJ.tar.xz $(stat -c %s "$OUT/partJ.tar.xz") bytes:" \
       "put it in the parts/ of the stage these runs came from ($SGSITE: .sgstage, or .sg023stage for" \
       "/tmp/sg023site) and run tools/gpu/carry_sglang.py for that stage"
fi
exit $rc
