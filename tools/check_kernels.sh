#!/usr/bin/env bash
# Compile every kernels/*.cu with nvcc for sm_80 and sm_90 (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" >/dev/null; then
  echo "check_kernels: nvcc not found; skipping the kernel compile check" >&2
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
shopt -s nullglob
files=(kernels/*.cu)
if [ ${#files[@]} -eq 0 ]; then echo "check_kernels: no kernels"; exit 0; fi
for f in "${files[@]}"; do
  for arch in sm_80 sm_90; do
    "$NVCC" -arch="$arch" --cubin -Werror all-warnings -o "$out/$(basename "$f" .cu).$arch.cubin" "$f"
  done
done
echo "check_kernels: ${#files[@]} kernel file(s) compiled for sm_80 and sm_90"
