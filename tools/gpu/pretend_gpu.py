"""pytest plugin for tools/gpu/preflight.sh: torch says a CUDA GPU is there, so GPU test modules
get past tests/gpu_env.py's skip and are imported (collected, never run) on a machine without one."""

import torch

torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda device=None: "pretend GPU"  # asked at import (SGLang's platform probe)
