#!/usr/bin/env bash
# Stage, in this checkout, what the GPU tests need on the GPU machine (Python 3.12, no package
# index): pyzmq, and KvikIO for the GPU Direct Storage tests (tests/cuda/test_gpu_gds.py) with
# what its wheels load (libkvikio finds cuFile and the RAPIDS logger through cuda-pathfinder),
# in .gpu/whl with the runner .gpu/run.sh, through ../shared/gpu/stage.sh (STAGE=path/to/stage.sh
# where the checkout has no ../shared beside it). About 6.5 MiB: carry .gpu with the tree.
#   bash tools/gpu/stage_gpu_tests.sh
# then on the GPU machine (a skip for any reason but a missing second GPU fails the run):
#   bash .gpu/run.sh bash tools/gpu/run_all.sh
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
cd "$repo"
STAGE=${STAGE:-$repo/../shared/gpu/stage.sh}
[ -f "$STAGE" ] || { echo "stage_gpu_tests: no $STAGE (set STAGE)" >&2; exit 2; }
bash "$STAGE" kvikio-cu13 libkvikio-cu13 rapids-logger cuda-pathfinder nvidia-cufile >/dev/null
for name in pyzmq kvikio_cu13 libkvikio_cu13 rapids_logger cuda_pathfinder nvidia_cufile; do
  ls .gpu/whl/"$name"-*.whl >/dev/null 2>&1 || { echo "stage_gpu_tests: no $name wheel" >&2; exit 1; }
done
echo "staged: $(ls .gpu/whl | tr '\n' ' ')"
echo ".gpu is $(du -sh .gpu | cut -f1) (carry limit 64 MiB with the rest)"
