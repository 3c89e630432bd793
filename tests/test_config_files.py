"""The shipped config file and the docs list exactly the knobs the code has."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from kvd.config import KNOBS, load_config

ROOT = Path(__file__).resolve().parent.parent
# What the shipped file sets on purpose, differently from the built-in defaults: metrics on for
# the systemd unit and the container image (kvd config prints defaults only).
SHIPPED = {"metrics_port": 9477}
SHIPPED_LINES = {"metrics_port = 0\n": "# Set in this shipped file (systemd unit, container image); "
                 "the built-in default is 0.\nmetrics_port = 9477\n"}


def test_shipped_toml_is_what_kvd_config_prints():
    printed = subprocess.run([sys.executable, "-m", "kvd", "config"], capture_output=True,
                             text=True, check=True).stdout
    for default, shipped in SHIPPED_LINES.items():
        printed = printed.replace(default, shipped)
    assert (ROOT / "configs" / "kvd.toml").read_text() == printed


def test_shipped_toml_loads_to_the_defaults_but_what_it_sets_on_purpose(tmp_path):
    cfg = load_config(str(ROOT / "configs" / "kvd.toml"), env={})
    assert cfg.as_dict() == {**load_config(None, env={}).as_dict(), **SHIPPED}
    assert set(tomllib.loads((ROOT / "configs" / "kvd.toml").read_text())) == {k.name for k in KNOBS}


def test_config_doc_lists_every_knob():
    doc = (ROOT / "docs" / "config.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", doc, re.M))
    assert documented == {k.name for k in KNOBS}


def test_readme_has_the_two_commands_and_ci_calls_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_service_unit_waits_for_readiness_and_has_a_watchdog():
    unit = (ROOT / "configs" / "kvd.service").read_text()
    settings = dict(line.split("=", 1) for line in unit.splitlines()
                    if "=" in line and not line.startswith("#"))
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert int(settings["WatchdogSec"]) >= 10 and settings["Restart"] == "on-failure"
    assert settings["RestartPreventExitStatus"] == "2"  # config errors: no restart loop
    assert "tools/check_service.sh" in unit and "is not executable" in unit  # the header says so


def test_the_license_is_an_spdx_expression():
    """PEP 639: a table (``{ text = ... }``) makes setuptools print a deprecation banner."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


def test_the_dockerfile_says_what_the_host_needs_and_waits_for_the_allocation():
    """The GPU path's driver (the base image is CUDA 13), the host's /run/kvd for uid 10001,
    and a health check that does not fail the container while the host tier is allocated."""
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM nvidia/cuda:(\d+)\.", text, re.M)
    header = text[:text.index("FROM ")]
    assert base and f"CUDA {base.group(1)}" in header and "driver" in header
    assert "install -d -o 10001 -g 10001" in header and "tmpfiles.d" in header
    assert "useradd --uid 10001" in text[len(header):]  # the uid the header names
    health = re.search(r"^HEALTHCHECK (.*?) CMD", text, re.M | re.S)
    period = re.search(r"--start-period=(\d+)m", health.group(1))
    assert period and int(period.group(1)) >= 5, health.group(0)
