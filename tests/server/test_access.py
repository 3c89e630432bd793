"""Engines as other users: access by group, kernel peer credentials, pool ownership.

The suite runs as root; the daemon and the engines here run under other
numeric uids through ``setpriv`` (no user or group is created): the daemon
as DAEMON with supplementary group GROUP and ``access_group = GROUP``,
engines as members of GROUP or as an outsider. Engines are real client
processes (tests/workers_access.py) on the real sockets.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import workers_access

from kvd_protocol.runtime import engine_endpoint

GROUP, DAEMON, ENGINE, OTHER_ENGINE, OUTSIDER = 61000, 61001, 61002, 61003, 61004
WORKER = str(Path(workers_access.__file__))

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to run processes as other uids")


def as_user(uid: int, groups=()) -> list:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups", "--"]


def run_as(uid: int, groups, role: str, timeout: float = 60, **args) -> dict:
    out = subprocess.run([*as_user(uid, groups), sys.executable, WORKER, role, json.dumps(args)],
                         capture_output=True, text=True, timeout=timeout, env=_env())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env() -> dict:
    tests = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
            "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture
def shared_daemons(start_daemon):
    """Start daemons running as DAEMON, serving GROUP, in runtime dirs others can reach."""
    base = Path(tempfile.mkdtemp(prefix="kvd-access-", dir="/tmp"))
    os.chmod(base, 0o755)
    started = []

    def start(**knobs):
        runtime = base / f"run{len(started)}"
        runtime.mkdir(mode=0o700)
        os.chown(runtime, DAEMON, DAEMON)
        started.append(start_daemon(runtime_dir=runtime, wrapper=as_user(DAEMON, [GROUP]),
                                    access_group=str(GROUP), **knobs))
        return started[-1]

    yield start
    for d in started:
        d.stop()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def shared_daemon(shared_daemons):
    return shared_daemons()


def test_an_engine_of_the_group_works_end_to_end(shared_daemon):
    st = os.stat(shared_daemon.runtime_dir)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o750, DAEMON, GROUP)
    for name in ("kvd.sock", "control.sock"):
        st = os.stat(shared_daemon.runtime_dir / name)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, DAEMON, GROUP), name
    out = run_as(ENGINE, [GROUP], "engine", runtime_dir=str(shared_daemon.runtime_dir), group=GROUP)
    assert out["stored"] == out["loaded"] == 2 * workers_access.CHUNK and out["bytes_match"]
    assert out["pool_mode"] == "0o660"
    mine = [s for s in out["sessions"] if s.get("uid") == ENGINE]
    assert len(mine) == 1 and mine[0]["gid"] == ENGINE and mine[0]["peer_pid"] == mine[0]["pid"]
    assert f"uid {ENGINE} gid {ENGINE} pid {mine[0]['pid']} (kernel)" in shared_daemon.log()


def test_a_uid_outside_the_group_is_refused(shared_daemon):
    rd = shared_daemon.runtime_dir
    # the kernel refuses first: the directory is 0750 of GROUP
    assert run_as(OUTSIDER, [], "connect", runtime_dir=str(rd))["error"] == "DaemonUnavailable"
    # with the file modes opened up by mistake, the daemon's credential check still refuses
    os.chmod(rd, 0o755)
    os.chmod(rd / "kvd.sock", 0o666)
    assert run_as(OUTSIDER, [], "connect", runtime_dir=str(rd))["error"] in ("DaemonUnavailable", "Timeout")
    assert f"refused a connection from uid {OUTSIDER} gid {OUTSIDER}" in shared_daemon.log()
    stats = shared_daemon.stats()
    assert stats["connections_refused"] >= 1 and stats["clients"] == 0
    # ... while a member of the group (supplementary only, as systemd's SupplementaryGroups=) gets in
    assert run_as(ENGINE, [GROUP], "connect", runtime_dir=str(rd)) == {"connected": True}


def test_a_client_naming_another_users_pool_file_is_refused(shared_daemon):
    rd = str(shared_daemon.runtime_dir)
    holder = subprocess.Popen([*as_user(ENGINE, [GROUP]), sys.executable, WORKER, "holder",
                               json.dumps({"runtime_dir": rd, "group": GROUP})],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        path = json.loads(holder.stdout.readline())["path"]
        assert os.stat(path).st_uid == ENGINE  # a live, registered pool the daemon can open
        out = run_as(OTHER_ENGINE, [GROUP], "borrower", runtime_dir=rd, group=GROUP, path=path)
        assert out["error"] == "BadRequest"
        assert (f"belongs to uid {ENGINE}, not to the registering process's uid {OTHER_ENGINE}"
                in out["message"])
    finally:
        holder.communicate("done\n", timeout=30)
    assert holder.returncode == 0


def test_a_session_spoken_for_from_another_process_is_forbidden(daemon, procs):
    import zmq

    from kvd_protocol import wire
    endpoint = engine_endpoint(daemon.runtime_dir)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"routing-id-of-a")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(wire.encode_request(1, "hello", {"client": "a", "pid": os.getpid(),
                                                             "versions": [wire.VERSION]}, ()))
        assert sock.poll(5000)
        wire.parse_reply(sock.recv_multipart())
        assert procs.apply(workers_access.takeover, (endpoint, b"routing-id-of-a")) == "forbidden"
        deadline = time.monotonic() + 5
        while daemon.stats()["clients"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.stats()["clients"] == 1  # the session itself is untouched
    finally:
        sock.close(linger=0)
        ctx.term()


def test_without_access_group_the_dir_and_sockets_are_the_daemons_users_only(start_daemon, tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o750)  # left open by an earlier daemon with a group: closed again
    os.chmod(runtime, 0o750)
    d = start_daemon(runtime_dir=runtime)
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    for name in ("kvd.sock", "control.sock"):
        assert stat.S_IMODE(os.stat(runtime / name).st_mode) & 0o077 == 0, name
    d.stop()


def test_tenant_labels_bound_to_users_and_groups(shared_daemons):
    """Before, a tenant label was whatever the client said: any member of the group could
    store under another tenant's label (and use up its quota)."""
    team = 61010  # a group only ENGINE is in
    d = shared_daemons(quota=f'[{{tenant = "a", users = [{ENGINE}], host_max = "1MiB"}}, '
                             f'{{tenant = "t", groups = ["{team}"]}}, {{tenant = "free", '
                             f'host_max = "1MiB"}}]')
    labels = ["a", "t", "free", "unknown", None]
    mine = run_as(ENGINE, [GROUP, team], "tenant_stores", runtime_dir=str(d.runtime_dir),
                  group=GROUP, tenants=labels)
    assert mine == {"a": "ok", "t": "ok", "free": "ok", "unknown": "ok", "None": "ok"}
    other = run_as(OTHER_ENGINE, [GROUP], "tenant_stores", runtime_dir=str(d.runtime_dir),
                   group=GROUP, tenants=labels)
    assert other == {"a": "Forbidden", "t": "Forbidden", "free": "ok", "unknown": "ok",
                     "None": "ok"}
    groups = {(g["model"], g["tenant"]): g for g in d.stats()["quotas"]["groups"]}
    assert groups["*", "a"]["host_used_bytes"] > 0  # ENGINE's store only: nothing of OTHER's
    assert d.stats()["errors"] >= 2 and d.proc.poll() is None
