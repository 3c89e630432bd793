"""Evaluate every query of configs/grafana-kvd.json in a real Prometheus scraping a real kvd.

Starts ``kvd serve`` (metrics on, a disk tier), a Prometheus server
(``prometheus`` on PATH, e.g. Debian's package) scraping it every second,
stores and loads for a while through a host-backend pool, then runs each
panel's expression through Prometheus' query API with the dashboard's
variables filled in (``$instance`` = every instance, ``$__rate_interval`` =
5s). Prints, per query, the number of series or the error; exits 1 if any
query fails to parse or evaluate. Not part of CI (no Prometheus there):

    .venv/bin/python tools/check_dashboard.py
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(prom: int, expr: str) -> dict:
    url = f"http://127.0.0.1:{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as exc:
        return json.load(exc)


def traffic(rundir: str, seconds: float) -> int:
    import kvd_client
    pool = kvd_client.SharedKVPool("vllm_flash_attn", 2, 64, 16, 2, 8, "float16")
    rounds = 0
    try:
        with kvd_client.KvdClient(runtime_dir=rundir, raise_errors=True).connect() as c:
            c.register_kv(pool, model="dashboard")
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                tokens = np.arange(64) + rounds * 1000
                c.store(tokens, np.arange(4))
                c.lookup(tokens)
                c.lookup(tokens + 10**9)  # misses
                c.load(tokens, np.arange(4, 8))
                rounds += 1
    finally:
        pool.close()
    return rounds


def main() -> int:
    if shutil.which("prometheus") is None:
        print("check_dashboard: prometheus not found; skipping", file=sys.stderr)
        return 0
    base = Path(tempfile.mkdtemp(prefix="kvd-dash-"))
    kvd_port, prom_port = free_port(), free_port()
    (base / "prometheus.yml").write_text(
        f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: kvd\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{kvd_port}']}}]\n")
    kvd = subprocess.Popen([sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(base / "run"),
                            "--host-capacity", "64MiB", "--chunk-tokens", "16", "--metrics-port",
                            str(kvd_port), "--disk-dir", str(base / "disk"), "--disk-capacity", "32MiB",
                            "--disk-high-watermark", "0.1", "--log-level", "warning",
                            "--warm-restart", "false"])  # keeps nothing in /dev/shm
    prom = subprocess.Popen(["prometheus", f"--config.file={base / 'prometheus.yml'}",
                             f"--storage.tsdb.path={base / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    failed = 0
    try:
        time.sleep(3)
        print(f"traffic: {traffic(str(base / 'run'), 10)} rounds of store/lookup/lookup/load")
        time.sleep(2)
        dashboard = json.loads((ROOT / "configs" / "grafana-kvd.json").read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", "5s").replace("$instance", ".*")
                reply = query(prom_port, expr)
                if reply.get("status") != "success":
                    failed += 1
                    print(f"FAIL  {panel['title']}: {reply.get('error')}\n      {expr}")
                else:
                    print(f"ok    {len(reply['data']['result']):>3} series  {panel['title']}: "
                          f"{target.get('legendFormat') or expr[:50]}")
    finally:
        prom.terminate()
        kvd.terminate()
        prom.wait(30)
        kvd.wait(30)
        shutil.rmtree(base, ignore_errors=True)
    print(f"{failed} queries failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
