"""The processes of one fleet run, each in a process group of its own, and how they stop.

``Procs`` starts commands in new sessions with their output in a log file,
and ``stop`` ends one group (SIGTERM, then SIGKILL past a grace period);
``stop_all`` ends every group still running, newest first (the script calls
it on exit, error and Ctrl-C). ``server_cmd`` is the ``vllm serve`` of one
arm; ``wait_http`` waits for a URL to answer 200 while its process lives;
``kvd_*`` start, ask and stop the private daemon.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class Procs:
    def __init__(self, logs: Path):
        self.logs, self.running = logs, []
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: list, env: dict | None = None) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **(env or {})}, start_new_session=True)
        p.name = name
        self.running.append(p)
        return p

    def stop(self, p: subprocess.Popen, grace: float = 20.0) -> int:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        _wait_group(p, grace)  # its children (engine core, worker) clean up their shm files
        _signal_group(p, signal.SIGKILL)  # anything of its group left behind
        if p in self.running:
            self.running.remove(p)
        return p.returncode

    def stop_all(self) -> None:
        for p in reversed(list(self.running)):
            self.stop(p, grace=10.0)

    def tail(self, name: str, n: int = 3000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""


def _wait_group(p: subprocess.Popen, grace: float) -> None:
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(p.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def post(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=timeout) as r:
        return r.read()


def wait_http(url: str, p: subprocess.Popen, procs: Procs, timeout: float) -> float:
    """Seconds until ``url`` answered 200; exits with the end of ``p``'s log if ``p`` died."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if p.poll() is not None:
            sys.exit(f"{p.name} exited with {p.returncode}; the end of its log:\n{procs.tail(p.name)}")
        try:
            get(url, 2.0)
            return time.monotonic() - t0
        except (OSError, http.client.HTTPException):  # not listening yet; or a TCP self-connect
            time.sleep(0.5)
    sys.exit(f"{p.name} did not answer {url} within {timeout:.0f} s; the end of its log:\n"
             f"{procs.tail(p.name)}")


def server_cmd(args, arm: str, port: int, kvd_run: Path) -> list:
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model_dir),
           "--served-model-name", "fleet", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--seed", "0", "--max-model-len", str(args.max_model_len),
           "--load-format", "safetensors", "--disable-uvicorn-access-log",
           "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching",
           "--distributed-executor-backend", "uni",  # the worker in the engine core: one import less
           "--num-gpu-blocks-override", str(args.gpu_blocks),
           "--kv-cache-memory-bytes", str(args.gpu_blocks * args.block_bytes)]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    if not args.compile:
        cmd += ["--enforce-eager"]
    if args.gpu:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if arm == "native":
        cmd += ["--kv-offloading-size", f"{args.host_gib / args.servers:g}", "--kv-offloading-backend", "native"]
    elif arm == "lmcache":
        from .lmcache import connector_config  # noqa: PLC0415 (imports this module)
        cmd += ["--kv-transfer-config", connector_config(args)]
    elif arm == "kvd":
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "KvdConnector", "kv_connector_module_path": "kvd_client.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {
                # CUDA IPC: vLLM 0.34's extensible KV cache (lent by file descriptor) cannot
                # have the fixed size that makes the arms' GPU caches equal
                "runtime_dir": str(kvd_run), "kv_cache_sharing": "legacy_ipc"}})]
    return cmd


def kvd_start(args, procs: Procs, run: Path, cold: bool) -> subprocess.Popen:
    cmd = [args.daemon_python, "-m", "kvd", "serve", "--runtime-dir", str(run),
           "--host-capacity", f"{args.host_gib:g}GiB", "--gpu", "on" if args.gpu else "off"]
    p = procs.start("kvd", cmd + (["--cold"] if cold else []))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        if p.poll() is not None:
            sys.exit(f"kvd serve exited with {p.returncode}:\n{procs.tail('kvd')}")
        health = [args.daemon_python, "-m", "kvd", "health", "--runtime-dir", str(run), "--timeout", "0.5"]
        if subprocess.run(health, capture_output=True).returncode == 0:
            return p
        time.sleep(0.2)
    sys.exit(f"kvd serve did not become healthy:\n{procs.tail('kvd')}")


def kvd_stats(args, run: Path) -> dict:
    out = subprocess.run([args.daemon_python, "-m", "kvd", "stats", "--json", "--runtime-dir", str(run)],
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip()[-300:]}


def kvd_drop(args, run: Path) -> None:
    """Free the host tier a stopped daemon keeps in /dev/shm for a warm restart."""
    subprocess.run([args.daemon_python, "-m", "kvd", "drop-tier", "--runtime-dir", str(run)],
                   capture_output=True, timeout=60)
