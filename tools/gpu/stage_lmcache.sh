#!/usr/bin/env bash
# Stage LMCache for the fleet benchmark's `lmcache` arm (examples/fleet.py) on the GPU machine,
# beside the vLLM 0.26 that ../shared/gpu/vllm/stage.sh stages (run that first).
#
#   bash ../shared/gpu/vllm/stage.sh && bash tools/gpu/stage_lmcache.sh
#
# LMCache 0.5.3 is the newest release whose extensions link against torch 2.11 (the GPU machine's
# torch): 0.5.4-0.5.6 need c10::NotImplementedError(SourceLocation, std::string), which torch 2.11
# does not export, so their `lmcache.c_ops` cannot load there. Its wheel and the packages neither
# the GPU image nor the vLLM stage hold go into .vstage/cur1/partL.tar.xz, beside vLLM's part A,
# so the same first run unpacks both (the pair stays under the 64 MiB a run carries):
#
#   run 1, carrying .vstage/cur1:  bash .vstage/cur1/call1.sh && bash .vstage/cur1/call1_lmcache.sh
#   run 2, carrying .vstage/cur2:  bash .vstage/cur2/call2.sh python3 examples/fleet.py --arms lmcache ...
#
# CHECK_PY=/path/python3.12 (a venv with torch 2.11.0, as on the GPU machine) also imports what the
# arm needs from the staged site dirs here, and loads LMCache's CUDA extensions against that torch.
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
cd "$repo"
VERSION=${LMCACHE_VERSION:-0.5.3}
S=.vstage
shared=${SHARED_VLLM:-$repo/../shared/gpu/vllm}
[ -d $S/site/vllm ] && [ -d $S/cur1 ] || { echo "stage_lmcache: stage vLLM first (bash ../shared/gpu/vllm/stage.sh)" >&2; exit 2; }
[ -f "$shared/resolve_deps.py" ] || { echo "stage_lmcache: no $shared/resolve_deps.py (set SHARED_VLLM)" >&2; exit 2; }
L=$S/lmcache
if [ -z "${PY312:-}" ]; then  # installs cp312 wheels into the site dir
  for c in "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 "$(command -v python3.12)"; do
    [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { PY312=$c; break; }
  done
fi
[ -n "${PY312:-}" ] || { echo "stage_lmcache: need a CPython 3.12 (set PY312)" >&2; exit 2; }
rm -rf $L && mkdir -p $L/whl $L/deps

echo "1/4 LMCache $VERSION (cp312, manylinux)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d $L/whl "lmcache==$VERSION"

echo "2/4 what neither the GPU image nor the vLLM stage has"
# Already in the vLLM stage: skipped by name. Left out on purpose: storage back ends the arm does not
# use (S3, Bigtable, NIXL) and pytest/setuptools pins that only packaging needs.
staged=$(ls $S/site | sed -n 's/^\([^-]*\)-.*\.dist-info$/\1/p' | tr '\n' ',')
skip="${staged}awscrt,google-cloud-bigtable,google-api-core,nixl,setuptools,setuptools-scm,pytest"
python3 "$shared/resolve_deps.py" $L/deps $L/whl/lmcache-$VERSION-*.whl --skip "$skip" | tee $L/deps/resolve.txt | tail -5

echo "3/4 one site dir, pruned"
"$PY312" -m pip install -q --no-index --no-deps --no-compile --target $L/site $L/deps/*.whl $L/whl/lmcache-*.whl
( cd $L/site && rm -rf bin lmcache/tools/cache_simulator/docs && du -sh . )

echo "4/4 partL.tar.xz into .vstage/cur1"
tar -C $L/site --owner=0 --group=0 -cf - . | xz -9 -T0 > $L/partL.tar.xz
find $S/cur1 -mindepth 1 ! -name partA.tar.xz ! -name call1.sh -delete  # only vLLM's run 1 and ours
ln -f $L/partL.tar.xz $S/cur1/partL.tar.xz
cp tools/gpu/call1_lmcache.sh $S/cur1/
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
carry=$(du -cb $S/cur1/* | tail -1 | cut -f1)
echo "run 1 carries $(( (tree + carry) / 1048576 )) MiB with the tree (limit 64)"
[ $(( tree + carry )) -lt $(( 64 * 1048576 )) ] || { echo "stage_lmcache: over the 64 MiB of one run" >&2; exit 1; }

if [ -n "${CHECK_PY:-}" ]; then
  echo "check: imports and CUDA extensions against $("$CHECK_PY" -c 'import torch; print(torch.__version__)')"
  PYTHONPATH=$S/site:$L/site "$CHECK_PY" - <<'EOF'
import importlib
for mod in ("lmcache.c_ops", "lmcache.native_storage_ops", "lmcache.v1.multiprocess.http_server",
            "lmcache.integration.vllm.lmcache_mp_connector",
            "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"):
    importlib.import_module(mod)
    print("  import", mod, "ok")
EOF
  PYTHONPATH=$S/site:$L/site "$CHECK_PY" -m lmcache.cli.main server --help | grep -q -- --l1-size-gb
  echo "  lmcache server --help ok"
fi
