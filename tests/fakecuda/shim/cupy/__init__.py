"""Test-only stand-in for CuPy: the fake GPU of tests/fakecuda, for a daemon under test.

Only tests put this directory on a daemon's PYTHONPATH (``fakecuda.daemon_env``),
never on the test process's own path, so ``import cupy`` in that daemon gets the
fake while kvd's code stays as it ships: no switch in production code. Importing
it loads the ``fakecuda`` package from its place in tests/ (without putting
tests/ on the path) and points ``kvd_protocol.cuda_driver`` at the fake libcuda.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _load_fakecuda():
    if "fakecuda" in sys.modules:
        return sys.modules["fakecuda"]
    package = Path(__file__).resolve().parents[2]  # tests/fakecuda
    spec = importlib.util.spec_from_file_location("fakecuda", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fakecuda"] = module
    spec.loader.exec_module(module)
    return module


_fake = _load_fakecuda()
from fakecuda.kernels import RawModule  # noqa: E402 - after the package is loaded

from . import cuda  # noqa: E402

_fake.driver.install()
__version__ = "0.0.0+fakecuda"
__all__ = ["RawModule", "cuda"]
