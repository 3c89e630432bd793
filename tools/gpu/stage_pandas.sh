#!/usr/bin/env bash
# Stage pandas for the fleet benchmark's multi-turn workload on the GPU machine (vLLM's `custom`
# dataset reads its JSONL with pandas; the GPU image and ../shared/gpu/vllm/stage.sh lack it).
#
#   bash tools/gpu/stage_pandas.sh          # here: .vstage/pandas (about 13 MB)
#
# On the GPU machine, after run 1 of the vLLM stage (.vstage/cur1) and before run 2:
#   run, carrying .vstage/pandas:  bash .vstage/pandas/install.sh
#   run 2, carrying .vstage/cur2:  bash .vstage/cur2/call2.sh python3 examples/fleet.py --workload multi_turn ...
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
cd "$repo"
D=.vstage/pandas
PY=${PY312:-/work/gpuimg/bin/python}  # any pip; the wheels are picked for the GPU's Python 3.12
rm -rf $D && mkdir -p $D
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d $D pandas python-dateutil tzdata 2> >(grep -v 'is ignored' >&2)
cat > $D/install.sh <<'EOS'
#!/usr/bin/env bash
# GPU machine: adds pandas to the vLLM stage's /tmp/vsite (run 1 made it).
set -eu
[ -d /tmp/vsite/vllm ] || { echo "MACHINE LOST: /tmp/vsite missing; run call 1 again first"; exit 42; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite "$(dirname "$0")"/*.whl
PYTHONPATH=/tmp/vsite python3 -c 'import pandas; print("pandas", pandas.__version__)'
EOS
ls -l $D
