"""``cupy.cuda`` of the fake GPU (tests/fakecuda/cupy_api.py)."""

from fakecuda.cupy_api import *  # noqa: F403
from fakecuda.cupy_api import __all__  # noqa: F401
