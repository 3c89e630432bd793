#!/usr/bin/env bash
# Stage SGLang 0.5.23 for the GPU machine as an overlay on the vLLM 0.34 staging: 0.5.23 pins
# torch==2.14.1, CuTe DSL 4.8.0, QuACK 0.6.5 and tvm-ffi 0.1.11, which .v034stage ships already
# (tools/gpu/stage_vllm034.sh); this adds what SGLang needs beyond them (SGLang, sglang-kernel
# 0.4.10's CUDA 13 build, flashinfer-python 0.7.2, transformers 5.19.0 and the pinned packages
# whose versions differ from vLLM's), pruned as tools/gpu/prune_sglang_site.sh prunes 0.5.16.
# It makes kvd's linker (kvd_client.sglang.linker, SGLang's UnifiedCacheLinker) testable on a GPU.
#
#   bash tools/gpu/stage_sglang023.sh              # here, in the project root, after stage_vllm034.sh
#   bash tools/gpu/stage_sglang023.sh --preflight  # again only the CPU import check (~1 min)
#
# Result (git-ignored): .sg023stage/parts/part*.tar.xz and the runs that carry them,
# .sg023stage/cur1, cur2, ... (tools/gpu/carry_sglang.py --stage .sg023stage). On the GPU machine,
# back to back: the vLLM 0.34 pieces (each run within 30 s of the last), then each curK run
# (bash .sg023stage/curK/call1.sh; the last: bash .sg023stage/curK/call2.sh COMMAND...); a later
# run with nothing carried: SGSITE=/tmp/sg023site bash tools/gpu/sglang_call2.sh COMMAND...
# Unpacked into /tmp/sg023site, which call2.sh puts before /tmp/v034site on PYTHONPATH.
set -euo pipefail
repo=$(git rev-parse --show-toplevel); cd "$repo"
here=tools/gpu
GPUPY=${GPUPY:-/work/gpuimg/bin/python}
RESOLVE=${RESOLVE:-$repo/../shared/gpu/vllm/resolve_deps.py}
CUTOFF=${CUTOFF:-2026-11-20T00:00:00Z}   # SGLang 0.5.23's wheel: 2026-10; vLLM 0.34's cutoff
BUDGET=${BUDGET:-$((58 << 20))}          # bytes one run may carry (64 MiB less the tree)
XZ=${XZ:--9}
S=.sg023stage BASE=.v034stage/site
[ -f $BASE/torch/__init__.py ] || { echo "stage vLLM 0.34 first (tools/gpu/stage_vllm034.sh): $BASE"; exit 1; }

PIP=(.sgstage/pip26/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

preflight() {  # import check on this CPU machine: the GPU image's Python, the overlay over the
  # base, a libcuda stub of every cu* symbol the extensions want (no GPU: torch says none)
  [ -f $S/cpufill/pynvml.py ] || {  # the image has it, its CPU copy not
    "${PIP[@]}" -d $S/cpufill nvidia-ml-py && "$GPUPY" -m pip install -q --no-index --no-deps --target $S/cpufill $S/cpufill/*.whl; }
  bash $here/cuda_stub.sh $S/cudastub $S/site/sgl_kernel $BASE/torch/lib
  rm -rf $S/torch_extensions  # SGLang's page hash is built afresh, as on a fresh GPU machine
  LD_LIBRARY_PATH=$S/cudastub PYTHONPATH=$S/site:$BASE:$repo/clients:$repo:.v034stage/cpufill/site:$S/cpufill \
    SGLANG_IS_FLASHINFER_AVAILABLE=false CPLUS_INCLUDE_PATH=$repo/$S/site/.include \
    TORCH_EXTENSIONS_DIR=$repo/$S/torch_extensions "$GPUPY" - "$S/site" <<'EOF2'
import importlib, sys, traceback, types
import torch
site, bad = sys.argv[1], 0
# sgl_kernel loads the ops of the GPU's compute capability: say 9.0 (H100/H200), the rest of torch
# still sees no GPU
torch.cuda.is_available, torch.cuda.current_device = (lambda: True), (lambda: 0)
torch.cuda.get_device_properties = lambda d=0: types.SimpleNamespace(major=9, minor=0)
import sgl_kernel
torch.cuda.is_available = lambda: False
mods = ["torch", "sglang", "sgl_kernel", "transformers", "flashinfer", "tvm_ffi",
        "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler", "sglang.srt.managers.tp_worker",
        "sglang.srt.model_executor.model_runner", "sglang.srt.models.llama",
        "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler",
        "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.allocator",
        "sglang.srt.mem_cache.unified_radix_cache",
        "sglang.srt.mem_cache.unified_cache.unified_cache_linker", "sglang.kernels.ops.kvcache.hicache",
        "kvd_client.sglang.linker", "kvd_client.sglang.backend"]
for m in mods:
    try:
        mod = importlib.import_module(m)
        print(f"ok   {m} {getattr(mod, '__version__', '')} {getattr(mod, '__file__', '')}")
    except BaseException as e:  # noqa: BLE001 - report everything
        bad += 1
        print(f"FAIL {m}: {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(limit=-3)
try:  # the page hash SGLang JIT-builds at its first hashed page, as on the GPU machine (call2.sh's path)
    from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash
    print("ok   HiCache page hash, built:", len(get_native_hash([1, 2, 3, 4], None, 2)), "page hashes")
except BaseException as e:  # noqa: BLE001
    bad += 1
    print(f"FAIL HiCache page hash: {type(e).__name__}: {e.__cause__ or e}"[:600])
import sglang, torch
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker
from kvd_client.sglang.linker import KvdLinker
left = sorted(getattr(KvdLinker, "__abstractmethods__", ()))
bad += bool(left) or not issubclass(KvdLinker, UnifiedCacheLinker)
print("sglang", sglang.__version__, "torch", torch.__version__, "| sgl_kernel ops from",
      sgl_kernel.common_ops.__file__.split("/site/")[-1], "| KvdLinker abstract left: %s" % left)
print("PREFLIGHT", "FAILED" if bad else "PASSED", f"({bad} failed)")
sys.exit(1 if bad else 0)
EOF2
  local rc=$?  # and the GPU tests that need 0.5.23 collect (torch pretending a GPU)
  LD_LIBRARY_PATH=$S/cudastub SGLANG_IS_FLASHINFER_AVAILABLE=false \
    PYTHONPATH=$S/site:$BASE:$repo/clients:$repo:$repo/tools/gpu:.v034stage/cpufill/site:$S/cpufill \
    "$GPUPY" -m pytest --collect-only -q -p pretend_gpu -p no:cacheprovider -m gpu tests/sglang/test_gpu_linker.py \
    2>&1 | tail -1 | tee /dev/stderr | grep -q -E "^[1-9][0-9]* tests? collected" || { echo "PREFLIGHT FAILED: collect"; rc=1; }
  return $rc
}
[ "${1:-}" = --preflight ] && { preflight; exit; }
grep -qxF "/$S/" .git/info/exclude 2>/dev/null || echo "/$S/" >> .git/info/exclude
mkdir -p $S/whl $S/parts
[ -x .sgstage/pip26/bin/python ] || { "$GPUPY" -m venv .sgstage/pip26 && .sgstage/pip26/bin/python -m pip install -q 'pip>=26'; }

# 1. the roots: SGLang, its kernels (CUDA 13, torch 2.14.1), flashinfer, the transformers it pins
"${PIP[@]}" -d $S/whl sglang==0.5.23 sglang-kernel==0.4.10 flashinfer-python==0.7.2 transformers==5.19.0 \
  2> >(grep -v 'is ignored' >&2)
unzip -o -q $S/whl/sglang_kernel-0.4.10-*.whl 'sgl_kernel/sm90/common_ops.abi3.so' -d $S/check
readelf -d $S/check/sgl_kernel/sm90/common_ops.abi3.so | grep -q 'libcudart.so.13' \
  || { echo "sglang-kernel 0.4.10 here is not the CUDA 13 build"; exit 1; }

# 2. SGLang's hard requirements (no extras), the image's and the heavy optional ones skipped
#    (as for 0.5.16); then what .v034stage ships already, the same version, left out
SKIP=flash-attn-4,helion,humming-kernels,nvidia-cutlass-dsl,nvidia-mathdx,quack-kernels,sgl-deep-gemm
SKIP=$SKIP,tilelang,tokenspeed-mla,torchcodec,py-spy,modelscope,datasets,soundfile,nvidia-cudnn-frontend
SKIP=$SKIP,cuda-tile,kernels,smg-grpc-servicer,outlines,torchao,cuda-python,sgl-deep-ep,sgl-flash-mla
SKIP=$SKIP,deepseek-recipe,tml-renderers,nvshmem4py-cu13,torch-memory-saver,torchaudio,decord2,av
SKIP=$SKIP,sglang-kernel,flashinfer-python,transformers,apache-tvm-ffi  # the roots; tvm-ffi: v034's
rm -rf $S/deps && mkdir -p $S/deps
python3 "$RESOLVE" $S/deps $S/whl/sglang-0.5.23-*.whl --pip .sgstage/pip26/bin/python --prior-to "$CUTOFF" \
  --skip "$SKIP" --extra-roots 'dill' 2>&1 | grep -v 'is ignored' | tee $S/deps/resolve.txt
for w in $S/deps/*.whl; do  # name-version of a wheel == a dist-info of the base: already there
  nv=$(basename "$w" | cut -d- -f1-2)
  if ls -d $BASE/"$nv".dist-info >/dev/null 2>&1; then echo "in $BASE: $nv"; rm "$w"; fi
done

# 3. one site dir, pruned; it names the site it lies over (call2.sh checks that one is complete)
rm -rf $S/site
"$GPUPY" -m pip install -q --no-index --no-deps --no-compile --target $S/site $S/deps/*.whl $S/whl/*.whl \
  2>&1 | grep -v 'is ignored' || true
bash $here/prune_sglang_site.sh $S/site
rm -rf $S/site/triton_kernels  # sglang-kernel's copy of Triton's MoE kernels: no Llama path
# 0.5.23 JIT-builds its HiCache page hash (hash_binding.cpp, torch.utils.cpp_extension) at the first
# hashed page: it includes pybind11, whose headers came with torch/include, which the vLLM 0.34 pieces
# prune; the headers of the same torch wheel go in ./.include, which call2.sh adds to g++'s path
rm -rf $S/site/.include && mkdir -p $S/site/.include
unzip -q -o .v034stage/over/torch-2.14.1-*.whl 'torch/include/pybind11/*' -d $S/site/.include/wheel
mv $S/site/.include/wheel/torch/include/pybind11 $S/site/.include/ && rm -rf $S/site/.include/wheel

# 4. archives that each unpack alone: A (all but sgl_kernel), B (sgl_kernel); then the runs
find $S/parts -mindepth 1 -name 'part*' ! -name 'partJ*' -delete  # partJ: the JIT's modules a GPU run sent back
mkdir -p $S/site/.sgparts && printf 'partA\npartB\n' > $S/site/.sgparts/expected
echo /tmp/v034site > $S/site/.sgparts/base && touch $S/site/.sgparts/part{A,B}
pack() {  # name, then tar arguments
  local name=$1; shift
  ( cd $S/site && tar --owner=0 --group=0 -cf - "$@" ./.sgparts/$name ) | xz $XZ -T0 > $S/parts/$name.tar.xz
}
pack partA --exclude=./sgl_kernel --exclude=./.sgparts/partB .
pack partB ./sgl_kernel
python3 $here/carry_sglang.py --stage $S --site /tmp/sg023site --budget "$BUDGET"
preflight
