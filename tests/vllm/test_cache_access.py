"""kvd_client.vllm.access without vLLM: the sharing mode ``auto`` resolves to, and
``may_load_async``'s answer (vLLM 0.34 asks both; test_api_034.py asks through vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

from kvd_client.vllm.access import VERSIONS_TESTED, may_load_async, sharing, version_note
from kvd_client.vllm.settings import Settings


def test_auto_follows_the_daemons_fd_socket(tmp_path):
    s = Settings(runtime_dir=str(tmp_path))
    assert sharing(s) == "legacy_ipc"
    (tmp_path / "fds.sock").touch()
    assert sharing(s) == "fd"
    assert sharing(Settings(runtime_dir=str(tmp_path), kv_cache_sharing="legacy_ipc")) == "legacy_ipc"
    (tmp_path / "fds.sock").unlink()
    assert sharing(Settings(runtime_dir=str(tmp_path), kv_cache_sharing="fd")) == "fd"


def test_may_load_async_is_yes_for_prompts_whose_hits_load_asynchronously():
    s = Settings(async_load_min_tokens=1000)
    long, short = SimpleNamespace(num_prompt_tokens=1001), SimpleNamespace(num_prompt_tokens=1000)
    assert may_load_async(s, long, loads=True) and not may_load_async(s, short, loads=True)
    assert not may_load_async(s, long, loads=False)  # kv_producer: kvd never loads
    assert may_load_async(Settings(async_load_min_tokens=0), SimpleNamespace(num_prompt_tokens=1),
                          loads=True)


def test_version_note_names_the_tested_releases():
    assert version_note("0.32.0") is None and version_note("0.26.0") is None
    assert version_note("0.33.1") == ("kvd: the connector knows vLLM 0.26, 0.32, 0.34 (docs/vllm.md "
                                      "says how each was tested), not 0.33.1; it may work")


def test_the_vllm_extra_admits_only_the_tested_releases():
    """``pip install 'kvd[vllm]'`` never resolves to a vLLM the tests did not run."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    (req,) = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["vllm"]
    spec = Requirement(req).specifier
    for minor in range(20, 41):
        for patch in (0, 3):
            version = f"0.{minor}.{patch}"
            assert spec.contains(version) == (f"0.{minor}" in VERSIONS_TESTED), (version, req)
