#!/usr/bin/env bash
# Stage SGLang 0.5.16 for the GPU machine (torch 2.11.0+cu130, Python 3.12, no network,
# at most 64 MiB of files per run): the newest SGLang that pins torch==2.11.0.
# Run it in the root of the checkout the GPU runs are sent from:
#
#   bash tools/gpu/stage_sglang.sh          # ~10 min the first time (2 cores)
#
# What it makes (git-ignored through .git/info/exclude, under .sgstage/):
#   parts/partA.tar.xz  SGLang 0.5.16, flashinfer-python 0.6.14 (Python only), the missing
#                       packages of SGLang's hard requirements, transformers 5.12.1 and
#                       tokenizers 0.22.2 (the image's 5.17 / 0.23.2 are refused by 0.5.16)
#   parts/partB.tar.xz  sglang-kernel 0.4.5 (CUDA 13 build): sgl_kernel/ with its sm90 ops
#   parts/partC.tar.xz.KofN  with WITH_FA3=1 only: FlashAttention 3 (sgl_kernel/flash_ops),
#                       141 MiB compressed, in pieces of at most BUDGET bytes
#   cur1/, cur2/, ...: what each run carries (tools/gpu/carry_sglang.py), with call1.sh
#   (unpack) in each and call2.sh (unpack, check, run) in the last.
# It prints each run's carry list and command at the end (docs/sglang.md, "On a GPU").
#
# Left out (measured; docs/sglang.md): sgl_kernel/flash_ops.abi3.so (FlashAttention 3 and 2,
# 1.12 GB, 141 MiB as xz) unless WITH_FA3=1: runs use --attention-backend triton; the sm100
# (Blackwell) ops, FlashMLA and InfLLM ops; flashinfer's copies of CUTLASS and CCCL (its own
# sources stay: SGLang 0.5.16's RMSNorm JIT-builds flashinfer's norm kernel at first use);
# xgrammar's static library; heavy optional requirements (SKIP below).
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
cd "$repo"
here=tools/gpu
RESOLVE=${RESOLVE:-$repo/../shared/gpu/vllm/resolve_deps.py}  # its DEVICE list: the image's packages
[ -f "$RESOLVE" ] || { echo "need shared/gpu/vllm/resolve_deps.py (set RESOLVE)"; exit 1; }
if [ -z "${PY312:-}" ]; then  # any CPython 3.12 that runs (pyenv shims may not)
  for c in "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 \
           /usr/local/bin/python3.12 "$(command -v python3.12)"; do
    [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { PY312=$c; break; }
  done
fi
[ -n "${PY312:-}" ] || { echo "need a CPython 3.12 (set PY312)"; exit 1; }
CUTOFF=${CUTOFF:-2026-08-01T00:00:00Z}   # a week after SGLang 0.5.16's wheel was built
BUDGET=${BUDGET:-$((60 << 20))}          # bytes one run may carry (64 MiB less the tree)
XZ=${XZ:--9}
S=.sgstage
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF "/$S/" "$exclude" 2>/dev/null || echo "/$S/" >> "$exclude"
mkdir -p $S/whl $S/parts
[ -x $S/pip26/bin/python ] || { "$PY312" -m venv $S/pip26 && $S/pip26/bin/python -m pip install -q 'pip>=26'; }
PIP=($S/pip26/bin/python -m pip)
PLAT=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# 1. the roots, no deps: SGLang, its kernels, flashinfer, and the two image packages it refuses
ROOTS=(sglang==0.5.16 sglang-kernel==0.4.5 flashinfer-python==0.6.14 transformers==5.12.1 tokenizers==0.22.2)
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  -d $S/whl "${ROOTS[@]}"
unzip -p $S/whl/sglang-0.5.16-*.whl '*/METADATA' | grep -E '^Requires-Dist: (torch|sglang-kernel|flashinfer)'
unzip -o -q $S/whl/sglang_kernel-0.4.5-*.whl 'sgl_kernel/sm90/common_ops.abi3.so' -d $S/check
readelf -d $S/check/sgl_kernel/sm90/common_ops.abi3.so | grep -q 'libcudart.so.13' \
  || { echo "sglang-kernel 0.4.5 here is not the CUDA 13 build"; exit 1; }

# 2. the missing requirements: SGLang's Requires-Dist walked (no extras), the image's skipped
SKIP=flash-attn-4,helion,humming-kernels,nvidia-cutlass-dsl,nvidia-mathdx,quack-kernels,sgl-deep-gemm
SKIP=$SKIP,tilelang,tokenspeed-mla,torchcodec,py-spy,modelscope,datasets,soundfile,nvidia-cudnn-frontend
SKIP=$SKIP,cuda-tile,kernels,smg-grpc-servicer,outlines,torchao,cuda-python
SKIP=$SKIP,sglang-kernel,flashinfer-python,transformers  # the roots above
rm -rf $S/deps && mkdir -p $S/deps
python3 "$RESOLVE" $S/deps $S/whl/sglang-0.5.16-*.whl --pip $S/pip26/bin/python --prior-to "$CUTOFF" \
  --skip "$SKIP" --extra-roots 'apache-tvm-ffi==0.1.11,dill' 2>&1 | grep -v 'is ignored' | tee $S/deps/resolve.txt

# 3. one site dir (what pip install --target makes), then prune
rm -rf $S/site
"$PY312" -m pip install -q --no-index --no-deps --no-compile --target $S/site $S/deps/*.whl $S/whl/*.whl
bash $here/prune_sglang_site.sh $S/site

# 4. archives that each unpack alone: A (all but sgl_kernel), B (sgl_kernel), with WITH_FA3=1
#    C (FlashAttention 3, sgl_kernel/flash_ops.abi3.so) in pieces of at most BUDGET bytes
find $S/parts -mindepth 1 -name 'part*' ! -name 'partJ*' -delete  # partJ: the JIT's modules a GPU run sent back
names="partA partB"; [ "${WITH_FA3:-0}" = 1 ] && names="$names partC"
mkdir -p $S/site/.sgparts && echo $names | tr ' ' '\n' > $S/site/.sgparts/expected && touch $S/site/.sgparts/part{A,B,C}
pack() {  # name, then tar arguments
  local name=$1; shift
  ( cd $S/site && tar --owner=0 --group=0 -cf - "$@" ./.sgparts/$name ) | xz $XZ -T0 > $S/parts/$name.tar.xz
}
pack partA --exclude=./sgl_kernel --exclude=./.sgparts/partB --exclude=./.sgparts/partC .
pack partB --exclude=./sgl_kernel/flash_ops.abi3.so ./sgl_kernel
if [ "${WITH_FA3:-0}" = 1 ]; then
  pack partC ./sgl_kernel/flash_ops.abi3.so
  split -b "$BUDGET" -d -a 2 $S/parts/partC.tar.xz $S/parts/partC.piece.
  n=$(ls $S/parts/partC.piece.* | wc -l); k=0
  for f in $S/parts/partC.piece.*; do k=$((k + 1)); mv "$f" "$S/parts/partC.tar.xz.${k}of$n"; done
  rm $S/parts/partC.tar.xz
fi
python3 $here/carry_sglang.py --budget "$BUDGET"
