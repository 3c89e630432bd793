"""Work units of ``pytest -n N --dist loadgroup`` (pytest-xdist), as the Makefile runs the suite.

Every test is a unit of its own, handed to whichever worker is free, except
the modules of ``GROUPS``: each group runs on one worker, its tests in
collection order, so what they share is set up once per run:

- ``vllm-engines``: the vLLM CPU engine tests share one engine server that
  imported vLLM (tests/vllm/engine_forks.py, session-scoped per worker);
- ``sglang``: the HiCache tests (test_hicache.py, test_hicache_vllm.py), each
  module sharing its module-scoped SGLang worker;
- ``sglang-radix``: the radix-cache tests share theirs (SGLang 0.5.16).

xdist hands out the largest units first, so both groups start at once, on
two workers, while the single tests fill in around them.

xdist's own ``xdist_group`` mark is not used: pytest-xdist 3.8 tags a group
by rewriting ``item._nodeid``, which pytest 9 no longer reads, so the mark
has no effect there. ``GroupScheduling`` groups by module path instead,
in the controller, where only node ids are known.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

GROUPS = {
    "tests/vllm/test_engine.py": "vllm-engines",
    "tests/vllm/test_models.py": "vllm-engines",
    "tests/vllm/test_corrupt.py": "vllm-engines",
    "tests/sglang/test_hicache.py": "sglang",
    "tests/sglang/test_hicache_vllm.py": "sglang",
    "tests/sglang/test_radix.py": "sglang-radix",
}


class GroupScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return GROUPS.get(nodeid.split("::", 1)[0], nodeid)
