"""The README's engine snippet runs as printed against a real daemon with default chunks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using it from an engine"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_engine_snippet_runs_as_printed(start_daemon):
    d = start_daemon(chunk_tokens=256, host_capacity="256MiB")
    code = readme_snippet() + (
        "\nassert len(page_ids) == 38 and cached == 0\n"
        "assert client.lookup(prompt_tokens) == 512  # two whole chunks of 256\n"
        "pool.raw[:] = np.random.default_rng(0).integers(0, 256, pool.raw.size, dtype=np.uint8)\n"
        "other = prompt_tokens + 1000\n"
        "assert client.store(other, page_ids) == 512\n"
        "assert client.load(other, np.arange(32, 64)) == 512\n"
        "for t in pool.tensors:\n"
        "    raw = t.view(np.uint8)\n"
        "    assert (raw[:, 32:64] == raw[:, 0:32]).all()\n"
        "pool.close(); client.close(); print('ok')\n")
    env = {**os.environ, "KVD_RUNTIME_DIR": str(d.runtime_dir)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
