"""pytest plugin for tools/gpu/preflight.sh: torch says a CUDA GPU is there, so GPU test modules
get past tests/gpu_env.py's skip and are imported (collected, never run) on a machine without one."""

import torch

torch.cuda.is_available = lambda: True
