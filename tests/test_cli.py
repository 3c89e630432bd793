"""The ``kvd`` command as a user meets it: help, typos, version, config, operator commands.

Every case runs the real ``kvd`` (``python -m kvd``) in a subprocess; the
operator commands talk to a real daemon (the ``daemon`` fixture) or to a
runtime dir where none listens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tomllib

import pytest
from daemons import default_sigint

from kvd import __version__


def kvd(*args, env=None, timeout=30, check=False):
    return subprocess.run([sys.executable, "-m", "kvd", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          check=check)


def test_version():
    out = kvd("--version", check=True)
    assert out.stdout.strip().startswith(f"kvd {__version__} (wire protocol v")


def test_serve_help_shows_sizes_choices_and_booleans_one_line_a_knob():
    from kvd.config import KNOBS
    text = kvd("serve", "--help", check=True).stdout
    flat = " ".join(text.split())
    assert "--host-capacity SIZE default: 1GiB" in flat
    assert "default: 64MiB" in flat and "default: 64GiB" in flat
    assert "1073741824" not in text and "67108864" not in text
    assert "--gpu {auto,on,off}" in flat and "--log-level {debug,info,warning,error}" in flat
    assert "--log-format {text,json}" in flat
    assert "--disk-gds {true,false} default: false" in flat
    assert "False" not in text
    assert "kvd config` prints each knob's help" in flat
    assert len(text.splitlines()) < len(KNOBS) + 15, text  # was some 380 lines with each whole help


@pytest.mark.parametrize("argv,hint", [
    (["serve", "--hostcapacity", "1GiB"], "--host-capacity"),
    (["serve", "--host_capacity=1GiB"], "--host-capacity"),
    (["serve", "--chunk-token", "16"], "--chunk-tokens"),
    (["stats", "--jsn"], "--json"),
])
def test_a_typo_gets_the_subcommands_usage_and_the_closest_flag(argv, hint):
    out = kvd(*argv)
    assert out.returncode == 2
    assert out.stderr.startswith(f"usage: kvd {argv[0]} ")
    assert f"did you mean {hint}?" in out.stderr
    assert "Traceback" not in out.stderr


def test_config_prints_the_defaults_and_resolved_prints_sources(tmp_path):
    defaults = kvd("config", check=True).stdout
    assert tomllib.loads(defaults)["host_capacity"] == "1GiB"
    conf = tmp_path / "kvd.toml"
    conf.write_text('chunk_tokens = 64\nhost_capacity = "2GiB"\n')
    env = {"KVD_MAX_CLIENTS": "9", "KVD_HOST_CAPACITY": "3GiB"}
    out = kvd("config", "--resolved", "--config", conf, env=env, check=True).stdout
    lines = {line.split(" = ")[0]: line for line in out.splitlines() if " = " in line}
    assert lines["chunk_tokens"] == "chunk_tokens = 64  # file"
    assert lines["host_capacity"] == 'host_capacity = "3GiB"  # env KVD_HOST_CAPACITY'
    assert lines["max_clients"] == "max_clients = 9  # env KVD_MAX_CLIENTS"
    assert lines["copy_threads"] == "copy_threads = 0  # default"
    assert tomllib.loads(out)["chunk_tokens"] == 64
    bad = kvd("config", "--resolved", env={"KVD_CHUNK_TOKENS": "many"})
    assert bad.returncode == 2 and bad.stderr.startswith("kvd: config error: chunk_tokens:")
    assert kvd("config", "--config", conf).returncode == 2  # --config needs --resolved
    assert kvd("config", "--defaults").returncode == 2  # the mode that did nothing is gone


def test_no_daemon_fails_at_once_and_says_what_to_check(tmp_path):
    """No control.sock: one line naming the dir and what to check, without waiting for the
    --timeout (30 s here; the subprocess gets 20)."""
    for command in (["health"], ["stats"], ["ctl", "clear"]):
        out = kvd(*command, "--runtime-dir", tmp_path, "--timeout", "30", timeout=20)
        assert out.returncode == 1
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
        assert str(tmp_path) in out.stderr and "kvd serve" in out.stderr
        assert "KVD_RUNTIME_DIR" in out.stderr


def test_a_stale_socket_fails_at_once(tmp_path):
    """A control.sock nobody listens on (a daemon killed with -9 leaves one)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "control.sock"))
    sock.close()
    out = kvd("health", "--runtime-dir", tmp_path, "--timeout", "30", timeout=20)
    assert out.returncode == 1 and "no kvd daemon listening" in out.stderr


def test_ctl_prints_one_line_and_json_on_request(daemon):
    rd = daemon.runtime_dir
    out = kvd("ctl", "clear", "--runtime-dir", rd, check=True).stdout
    assert out == "clear: dropped 0 host-tier chunks, kept 0 in use\n"
    reply = json.loads(kvd("ctl", "clear", "--json", "--runtime-dir", rd, check=True).stdout)
    assert reply == {"dropped": 0, "kept_in_use": 0}
    out = kvd("ctl", "flush-disk", "--runtime-dir", rd, check=True).stdout
    assert out.count("\n") == 1 and "no disk tier" in out
    out = kvd("health", "--runtime-dir", rd, check=True).stdout
    assert out.startswith(f"ok: pid {daemon.proc.pid}, backend host") and out.count("\n") == 1
    assert json.loads(kvd("health", "--json", "--runtime-dir", rd, check=True).stdout)["status"] == "ok"


def test_a_reader_that_stops_early_is_no_error(daemon):
    """``kvd stats | head -2``: the pipe's reader is gone before kvd writes (here: at once)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvd", "stats", "--runtime-dir",
                             str(daemon.runtime_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=30) == 0 and err == ""


@pytest.mark.parametrize("as_json", [False, True])
def test_stats_watch_repeats_until_ctrl_c(daemon, as_json):
    cmd = [sys.executable, "-m", "kvd", "stats", "--watch", "0.1", "--runtime-dir",
           str(daemon.runtime_dir)] + (["--json"] if as_json else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    marker = '{"tiers"' if as_json else "tier          capacity"
    seen, lines = 0, []
    try:
        while seen < 3:  # three snapshots printed, then Ctrl-C
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            lines.append(line)
            seen += line.startswith(marker)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in err, err
    if as_json:
        snapshots = [json.loads(line) for line in lines + out.splitlines()]
        assert all("tiers" in s for s in snapshots)
    assert kvd("stats", "--watch", "0", "--runtime-dir", daemon.runtime_dir).returncode == 2


def test_bench_disk_creates_its_dir_or_says_why(tmp_path):
    new = tmp_path / "new"
    out = kvd("bench", "--disk", "--disk-dir", new, "--disk-gib", "0.01", "--disk-chunk", "1MiB",
              "--repeat", "1", "--disk-threads", "1", timeout=120)
    assert out.returncode == 0, out.stderr
    assert new.is_dir() and "tier/raw" in out.stdout
    (tmp_path / "file").write_text("")
    for bad, why in ((tmp_path / "file", "not a directory"), (tmp_path / "file" / "x", "cannot create"),
                     (tmp_path / "typo" / "x", f"{tmp_path / 'typo'} does not exist")):
        out = kvd("bench", "--disk", "--disk-dir", bad)
        assert out.returncode == 2 and why in out.stderr and "Traceback" not in out.stderr
        assert out.stderr.count("\n") == 1


def test_bench_interference_refuses_unknown_variants_before_starting_anything():
    """A typo in a variant list fails at once with the valid names, not minutes into a GPU run."""
    out = kvd("bench", "--gpu", "--interference", "--interference-variants", "dma;dma, stagged",
              "--interference-workloads", "gemm,prefill")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "'dma, stagged', 'prefill'" in out.stderr and "dma, staged, stores only" in out.stderr
    assert out.stdout == ""


def test_bench_gpu_refuses_unknown_shapes_and_phases_before_starting_anything():
    for flag, bad, known in (("--gpu-shapes", "llama3-8b,gpt2", "deepseek-mla"),
                             ("--pipeline-phases", "both,loads", "store, load, both")):
        out = kvd("bench", "--gpu", "--pipeline", "2", flag, bad)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"unknown {bad.split(',')[1]}" in out.stderr and known in out.stderr
        assert out.stdout == ""


def test_bench_gpu_refuses_a_host_capacity_too_small_or_unreadable_before_starting_anything():
    """--gpu-host-capacity below the requests in flight, or not a size: one line, exit 2,
    before torch is imported (so this runs without a GPU)."""
    for size, why in (("3GB", "under the"), ("3 parsecs", "--gpu-host-capacity")):
        out = kvd("bench", "--gpu", "--pipeline", "4", "--chunks", "128", "--chunk-tokens", "16",
                  "--gpu-host-capacity", size)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert why in out.stderr and out.stdout == "", out.stderr


def test_bench_daemon_profile_writes_the_daemons_stats(tmp_path):
    """--daemon-profile: the private daemon's own request path is in the stats it leaves."""
    import pstats
    path = tmp_path / "daemon.prof"
    out = kvd("bench", "--layers", "2", "--chunks", "2", "--repeat", "1", "--daemon-profile", path,
              timeout=120)
    assert out.returncode == 0, out.stderr
    handled = [fn for (file, _, fn), row in pstats.Stats(str(path)).stats.items()
               if file.endswith("kvd/server/service.py") and fn == "handle"]
    assert handled, "the daemon's request handler is not in the profile"


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
@pytest.mark.parametrize("argv,install", [
    (["--gpu"], "pip install torch cupy-cuda13x"),
    (["--gpu", "--interference"], "pip install torch cupy-cuda13x"),
    (["--gds", "--disk-dir", "{tmp}/gds"], "kvikio-cu13"),
    (["--interference"], "pip install torch cupy-cuda13x"),  # implies --gpu: not the host bench
])
def test_bench_gpu_without_torch_says_what_to_install(tmp_path, argv, install):
    """One line naming the packages and the pip command, exit 2, nothing made (no
    --disk-dir), no traceback."""
    out = kvd("bench", *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.count("\n") == 1 and "PyTorch" in out.stderr and install in out.stderr
    assert not (tmp_path / "gds").exists()


@pytest.mark.parametrize("argv,error", [
    (["--layout", "flsh"], "argument --layout: invalid choice: 'flsh' (choose from 'vllm_flash_attn',"),
    (["--chunks", "0"], "argument --chunks: 0 is less than 1"),
    (["--repeat", "x"], "argument --repeat: 'x' is not a whole number"),
])
def test_bench_bad_values_are_a_usage_error_not_a_traceback(argv, error):
    out = kvd("bench", *argv)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    usage, message = out.stderr.splitlines()
    assert usage.startswith("usage: kvd bench [--gpu|") and message.startswith(f"kvd bench: error: {error}")


def test_a_misspelt_kvd_variable_gets_one_warning_naming_the_closest_knob():
    """kvd config --resolved: one line on stderr per unknown KVD_* variable; the project's own
    non-knob variables (KVD_VLLM_PYTHON, ...) are no typos."""
    env = {"KVD_HOST_CAPACTIY": "8GiB", "KVD_VLLM_PYTHON": "/x", "KVD_SGLANG_PYTHON": "/y"}
    out = kvd("config", "--resolved", env=env)
    assert out.returncode == 0 and tomllib.loads(out.stdout)["host_capacity"] == "1GiB"
    assert out.stderr == ("kvd: warning: environment variable KVD_HOST_CAPACTIY sets no kvd knob "
                          "and is ignored (did you mean KVD_HOST_CAPACITY?)\n")
    assert kvd("config", "--resolved", env={"KVD_VLLM_PYTHON": "/x"}).stderr == ""


def test_a_benchmark_too_large_for_this_machine_is_one_line_and_exit_1():
    """The private daemon refuses a host tier larger than /dev/shm: its own log line, then
    one line of kvd bench's, no traceback."""
    out = kvd("bench", "--chunks", "100000", "--layers", "64", timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1] == ("kvd bench: the benchmark daemon did not start (its log "
                                           "line above says why)"), out.stderr
    assert "does not fit: /dev/shm has" in out.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare "
                    "for a 1 MiB tmpfs in a private mount namespace")
def test_a_pool_larger_than_shm_dir_says_the_sizes_not_a_bare_enospc(tmp_path):
    code = ("from kvd_client import SharedKVPool\n"
            "try:\n"
            f"    SharedKVPool('vllm_flash_attn', 4, 64, 16, 8, 128, 'bfloat16', shm_dir='{tmp_path}')\n"
            "except OSError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f"mount -t tmpfs -o size=1m tmpfs {tmp_path} && exec {sys.executable} -c \"$0\"",
                          code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.match(rf"\[Errno 28\] a shared-memory pool of 16.0 MiB does not fit: {tmp_path} has "
                    r"[01]\.\d MiB free \(a smaller pool, or grow the tmpfs\)$", out.stdout), out.stdout
    assert list(tmp_path.iterdir()) == []  # the namespace's tmpfs is gone; nothing was left here
