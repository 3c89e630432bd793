"""``KVD_*`` environment variables that set no knob: the project's own, and typos.

``load_config`` (kvd.config) reads ``KVD_<KNOB>`` and nothing else, so a
misspelt variable (``KVD_HOST_CAPACTIY``) would change nothing,
silently. ``unknown_variables`` gives one warning line for each ``KVD_*``
variable that is neither a knob's nor in ``OTHER_VARIABLES``, naming the
closest knob's variable (difflib); the commands that load the config
print them (``kvd serve`` in its log, ``kvd config --resolved`` and
``kvd drop-tier`` on stderr). ``OTHER_VARIABLES`` lists every other
``KVD_*`` variable the project reads (tests/test_config.py checks that it
is complete): they are no typos.
"""

from __future__ import annotations

import difflib
import os
import sys

from kvd.config import KNOBS

OTHER_VARIABLES = (
    "KVD_VLLM_PYTHON",  # tests: the vLLM venv's python (make test sets it)
    "KVD_SGLANG_PYTHON",  # tests: the SGLang venv's python (make test sets it)
    "KVD_SGLANG_TRACE",  # SGLang backend and linker: the timeline file (kvd_client.sglang.timeline)
    "KVD_TEST_LOG_DIR",  # tests: where the daemons' logs are copied (the GPU machine)
    "KVD_EXTRAS",  # Dockerfile: the pip extras of the image (a build argument)
    "KVD_VLLM034_SRC",  # tests: vLLM 0.34's Python sources, from its wheel (make test sets it)
    "KVD_SGLANG016_SRC",  # tests: SGLang 0.5.16 beside the SGLang venv (make test sets it)
)


def knob_variables() -> list[str]:
    return [f"KVD_{k.name.upper()}" for k in KNOBS]


def unknown_variables(env=None) -> list[str]:
    """A warning line for each ``KVD_*`` variable of ``env`` (default: os.environ) that
    sets no knob and is none of the project's own."""
    env = os.environ if env is None else env
    knobs = knob_variables()
    known = set(knobs) | set(OTHER_VARIABLES)
    lines = []
    for name in sorted(n for n in env if n.startswith("KVD_") and n not in known):
        close = difflib.get_close_matches(name, knobs, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "kvd config lists the knobs"
        lines.append(f"environment variable {name} sets no kvd knob and is ignored ({hint})")
    return lines


def print_warnings() -> None:
    """``unknown_variables`` on stderr, for the commands that load the config but log nothing."""
    for line in unknown_variables():
        print(f"kvd: warning: {line}", file=sys.stderr)
