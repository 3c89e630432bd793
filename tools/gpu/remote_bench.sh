#!/usr/bin/env bash
# `kvd bench --remote` for Mooncake (TCP transport) and Redis on the GPU machine (16 cores, Python
# 3.12, no network): kvd's zero-copy and bytes paths against the store's own client on the same
# objects and parallelism, then the half-local, half-remote load against its halves; the bench
# starts mooncake_master from the staged wheel, and redis-server from .gpu/redis-server.tar.xz,
# on loopback itself (kvd/bench/stores.py). REMOTE_STORES (default "mooncake,redis" where the
# Redis server is staged, else "mooncake"): the bench's --remote-stores. Writes to $OUT
# (a temporary directory without it): machine.txt, remote_t<N>.json and .log per thread count,
# then remote_tests.log: the Mooncake zero-copy and layer-wise remote tests (real daemons).
#
# Stage here, from the checkout (it runs `bash ../shared/gpu/stage.sh
# mooncake-transfer-engine-non-cuda` and packs the system libraries Mooncake links into
# .gpu/mooncake-libs.tar.xz; .gpu/ is then ~50 MiB):
#   bash tools/gpu/stage_remote.sh
# Run there (device tool: command below, carry [".gpu"], about 5 minutes):
#   bash .gpu/run.sh bash tools/gpu/remote_bench.sh
# REMOTE_THREADS (default "4 8"; empty: set-up only): the bench's --remote-threads, one run each; REMOTE_ARGS
# replaces the other flags of every run (default: 32 chunks of 4 MiB, 7 rounds, an 8-layer
# Llama-3-8B shape for the load). REMOTE_DIGEST (default "-1"): the bench's
# --remote-digest-processes, one run each, after the thread count (e.g. "0 -1 0 -1": an A/B of
# kvd's checksum processes). Each run is cut at 240 s; REMOTE_TESTS=0 skips the tests
# (300 s at most).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT" || exit 2
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
export PATH="/tmp/site/bin:$PATH" PYTHONPATH="$PWD/clients:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Mooncake's binaries link libibverbs, libnuma and libcurl: the staged copies fill only the gaps
mc=$(python3 -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("mooncake").origin))') \
  || { echo "no mooncake package: stage it (tools/gpu/stage_remote.sh) and run through .gpu/run.sh"; exit 2; }
libs=/tmp/kvd-mooncake-libs
mkdir -p "$libs/all"
[ -f .gpu/mooncake-libs.tar.xz ] && python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
  .gpu/mooncake-libs.tar.xz "$libs/all"
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for _ in 1 2 3 4 5 6; do  # a library taken in may link others the image lacks too
  missing=$(ldd "$mc/mooncake_master" "$mc"/store*.so 2>/dev/null | awk '/not found/{print $1}' | sort -u)
  [ -z "$missing" ] && break
  for lib in $missing; do
    [ -f "$libs/all/$lib" ] && ln -sf "$libs/all/$lib" "$libs/$lib"
  done
done
stores=mooncake
if [ -f .gpu/redis-server.tar.xz ]; then
  mkdir -p /tmp/kvd-redis
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    .gpu/redis-server.tar.xz /tmp/kvd-redis
  export PATH="/tmp/kvd-redis:$PATH"
  stores=mooncake,redis
fi
stores=${REMOTE_STORES:-$stores}
{
  echo "cores: $(nproc)"; grep -m1 'model name' /proc/cpuinfo; free -g | head -2
  python3 -c 'import sys, numpy, xxhash, zmq, msgpack; print("python", sys.version.split()[0], "numpy", numpy.__version__, "xxhash", xxhash.VERSION, "pyzmq", zmq.__version__)'
  echo "libraries taken from .gpu: $(ls "$libs" | grep -v '^all$' | tr '\n' ' ')"
  python3 -c 'from kvd.bench.stores import MooncakeMaster as M; print("mooncake_master:", M.missing() or "ok")'
  python3 -c 'from kvd.bench.stores import RedisServer as R; print("redis-server:", R.missing() or "ok")'
} 2>&1 | tee "$OUT/machine.txt"
grep -q 'mooncake_master: ok' "$OUT/machine.txt" || { echo "mooncake_master cannot run here"; exit 2; }
rc=0 run=0
for threads in ${REMOTE_THREADS-4 8}; do
  for digest in ${REMOTE_DIGEST:--1}; do
    name="t$threads"; [ "${REMOTE_DIGEST:--1}" = "-1" ] || name="t${threads}_p${digest}_$((++run))"
    echo "== kvd bench --remote --remote-stores $stores --remote-threads $threads --remote-digest-processes $digest"
    # shellcheck disable=SC2086
    timeout 240 python3 -m kvd bench --remote --remote-stores "$stores" --remote-threads "$threads" \
      --remote-digest-processes "$digest" \
      ${REMOTE_ARGS:---remote-chunks 32 --remote-chunk-mib 4 --repeat 7 --layers 8 --chunks 8} \
      --json "$OUT/remote_$name.json" 2>&1 | grep -v -E '^[IWE][0-9]{4} |^WARNING: Logging before' \
      | tee "$OUT/remote_$name.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "REMOTE BENCH FAILED (threads $threads)"; rc=1; }
  done
done
if [ "${REMOTE_TESTS:-1}" = 1 ]; then  # the zero-copy path's real-daemon tests, on these cores
  echo "== pytest (zero-copy and layer-wise remote loads)"
  filter="not redis"; [[ $stores == *redis* ]] && filter=""
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -k "$filter" \
    tests/tiers/test_remote_zero_copy.py tests/tiers/test_remote_layerwise.py 2>&1 \
    | grep -v -E '^[IWE][0-9]{4} ' | tee "$OUT/remote_tests.log" | tail -n 15
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "REMOTE TESTS FAILED"; rc=1; }
fi
echo "results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
