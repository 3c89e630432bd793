#!/usr/bin/env bash
# Stage, in this checkout, what tools/gpu/remote_bench.sh needs on the GPU machine (Python 3.12,
# no network, no pyzmq or Mooncake installed): the wheels (pyzmq, and the Mooncake wheel kvd's
# `mooncake` extra names) in .gpu/whl through ../shared/gpu/stage.sh, and in
# .gpu/mooncake-libs.tar.xz the shared libraries Mooncake's binaries link from the system
# (libibverbs, libnuma, libcurl and what they link; glibc and libstdc++ excepted), taken from
# this machine: the GPU image may lack them, and remote_bench.sh uses only those it lacks.
# For the Redis bench there: the redis-py wheel, and in .gpu/redis-server.tar.xz this machine's
# redis-server (or valkey-server) with every library it links but glibc's, and a wrapper that
# runs it with them.
#   bash tools/gpu/stage_remote.sh        # then: du -sh .gpu (carry limit: 64 MiB)
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
cd "$repo"
bash ../shared/gpu/stage.sh mooncake-transfer-engine-non-cuda redis >/dev/null
wheel=$(ls .gpu/whl/mooncake_transfer_engine_non_cuda-*-cp312-*.whl | head -n 1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$tmp"
chmod +x "$tmp"/mooncake/mooncake_master
mkdir -p "$tmp/lib"
ldd "$tmp"/mooncake/mooncake_master "$tmp"/mooncake/store*.so \
  | awk '/=> \//{print $3}' | sort -u \
  | grep -v -E '/(libc|libm|libpthread|libdl|librt|libresolv|libstdc\+\+|libgcc_s)\.so' \
    | grep -v "$tmp" | while read -r lib; do cp -L "$lib" "$tmp/lib/"; done
tar -cJf .gpu/mooncake-libs.tar.xz -C "$tmp/lib" .
if ldd "$tmp"/mooncake/mooncake_master | grep -q 'not found'; then
  echo "stage_remote: mooncake_master cannot load all its libraries here either:" >&2
  ldd "$tmp"/mooncake/mooncake_master | grep 'not found' >&2
  exit 1
fi
server=$(command -v valkey-server || command -v redis-server || true)
if [ -n "$server" ]; then
  mkdir -p "$tmp/redis/lib"
  cp -L "$server" "$tmp/redis/redis-server.bin"
  ldd "$server" | awk '/=> \//{print $3}' \
    | grep -v -E '/(libc|libm|libpthread|libdl|librt|libresolv)\.so' \
    | while read -r lib; do cp -L "$lib" "$tmp/redis/lib/"; done
  printf '%s\n' '#!/bin/sh' \
    'here=$(dirname "$(readlink -f "$0")")' \
    'LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/redis-server.bin" "$@"' \
    >"$tmp/redis/redis-server"
  chmod +x "$tmp/redis/redis-server"
  tar -cJf .gpu/redis-server.tar.xz -C "$tmp/redis" .
else
  echo "stage_remote: no redis-server or valkey-server here: the GPU run benches Mooncake only" >&2
fi
echo "staged: $(ls .gpu/whl | tr '\n' ' ')"
echo "libraries: $(ls "$tmp/lib" | wc -l) in .gpu/mooncake-libs.tar.xz; .gpu is $(du -sh .gpu | cut -f1) (carry limit 64 MiB)"
