#!/usr/bin/env bash
# For the staging preflights, here (no GPU): OUT/libcuda.so.1, a stub defining every cu* symbol
# the shared objects under the given paths want (each returns 100, "no device"), so their
# extensions load and import on this machine.
#
#   bash tools/gpu/cuda_stub.sh OUT PATH...
set -euo pipefail
out=$1; shift
mkdir -p "$out"
find "$@" -name '*.so*' -exec nm -D --undefined-only {} + 2>/dev/null | awk '{print $2}' | sed 's/@.*//' \
  | grep -E '^cu[A-Z]' | sort -u | sed 's/.*/int &(void){return 100;}/' > "$out/stub.c"
gcc -shared -fPIC -o "$out/libcuda.so.1" -Wl,-soname,libcuda.so.1 "$out/stub.c"
