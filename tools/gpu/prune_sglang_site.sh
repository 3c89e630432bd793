#!/usr/bin/env bash
# Prune a staged SGLang site dir (tools/gpu/stage_sglang.sh: 0.5.16; stage_sglang023.sh:
# 0.5.23 over the vLLM 0.34 staging) to what a Llama on
# Hopper needs with --attention-backend triton and --sampling-backend pytorch:
#
#   bash tools/gpu/prune_sglang_site.sh .sgstage/site          # WITH_FA3=1: keep FlashAttention 3
#
# Each line says what goes and why; sizes are of the unpacked files (2026-11-28).
set -euo pipefail
cd "$1"
rm -rf bin share                                   # console scripts, Jupyter data
[ "${WITH_FA3:-0}" = 1 ] ||
  rm -f sgl_kernel/flash_ops.abi3.so               # FlashAttention 3/2, 1.12 GB: triton attention
rm -rf sgl_kernel/sm100                            # common_ops for compute capability != 9.0, 19 MB
rm -f sgl_kernel/flashmla_ops.abi3.so              # MLA models only, 15 MB (loaded lazily)
rm -f sgl_kernel/infllm_ops.*.so                   # InfLLM-v2 attention, 29 MB (loaded lazily)
rm -rf flashinfer/data/cutlass flashinfer/data/cccl  # 55 MB of JIT sources no Llama op needs;
                                                   # csrc/include stay: 0.5.16's RMSNorm is
                                                   # flashinfer's, JIT-built at first use
rm -rf xgrammar/lib                                # a static library, 62 MB
[ ! -f xgrammar/libxgrammar_bindings.so ] ||        # 53 MB -> 3 MB (an overlay may lack it)
  strip --strip-debug xgrammar/libxgrammar_bindings.so
rm -f zstandard/_cffi.*.so                         # the C backend stays (its default)
rm -rf jedi/third_party                            # typeshed stubs for IPython's completion, 32 MB
rm -rf sglang/multimodal_gen                       # the diffusion runtime, 12 MB
find . -name __pycache__ -prune -exec rm -rf {} +
du -sh .
