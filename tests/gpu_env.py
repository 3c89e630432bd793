"""What a GPU test module needs before it imports anything of the GPU path.

``torch = require_gpu()`` at module level: skips the whole module (with the
reason) without torch, CuPy or a visible CUDA GPU, else returns torch.
"""

from __future__ import annotations

import pytest


def require_gpu():
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU", allow_module_level=True)
    return torch
