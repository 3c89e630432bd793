"""``--only-skips REGEX``: a run that may skip only for reasons it expects.

Hooks imported by tests/conftest.py. With the option, the end of the run
lists every skipped test or module with its reason, and a skip whose reason
does not match REGEX (``re.search``) fails the run: on the GPU machine a
test that skips for a missing package is a test that never ran
(``tools/gpu/run_all.sh`` passes ``--only-skips 'needs two'``). Without the
option nothing changes. Tests marked xfail are not skips.
"""

from __future__ import annotations

import re

import pytest

_SKIPS = pytest.StashKey[list]()
_CONFIG: list = []  # this run's config (reports do not carry it)


def pytest_addoption(parser):
    parser.addoption("--only-skips", metavar="REGEX", default=None,
                     help="list the skips at the end and fail the run on one whose reason "
                          "does not match REGEX (e.g. 'needs two')")


def pytest_configure(config):
    _CONFIG[:] = [config]


def _record(report) -> None:
    config = _CONFIG[0]
    if config.getoption("only_skips") is None or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    config.stash.setdefault(_SKIPS, []).append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_runtest_logreport(report):
    _record(report)


def pytest_collectreport(report):
    _record(report)


def pytest_sessionfinish(session):
    pattern = session.config.getoption("only_skips")
    if pattern is None or hasattr(session.config, "workerinput"):
        return  # under xdist the controller sees every worker's reports
    skips = session.config.stash.get(_SKIPS, [])
    unexpected = [(node, why) for node, why in skips if not re.search(pattern, why)]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reporter.write_sep("-", f"{len(skips)} skips (allowed: {pattern!r})")
    for node, why in skips:
        bad = (node, why) in unexpected
        reporter.write_line(f"  {'UNEXPECTED ' if bad else ''}{node}: {why}", red=bad)
    if unexpected:
        reporter.write_line(f"FAILED: {len(unexpected)} skips for a reason not allowed", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
