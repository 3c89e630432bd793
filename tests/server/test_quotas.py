"""Quotas of a real daemon (the ``quota`` knob), driven by real clients.

A tenant with ``host_max`` that fills its cap evicts only its own chunks
(another tenant's all still hit), and its usage, evictions and refusals
show in ``kvd stats`` (table and JSON) and on /metrics; a ``host_reserve``
keeps other stores from evicting a tenant's chunks; a model whose chunks
are all leased gets ``over_quota`` and loses nothing; ``disk_max`` caps a
tenant's disk files (its oldest chunks no longer in the host tier go first;
else its demotions are refused); a bad quota stops ``kvd serve`` with one
line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from test_metrics import free_port, scrape, value

import kvd_client

GEOMETRY = ("vllm_flash_attn", 2, 64, 4, 2, 8, "float16")  # 2 KiB per 16-token chunk
CHUNK, CHUNK_BYTES, FILE_BYTES = 16, 2048, 8192  # a chunk's tokens, slot, disk file


def tokens(seq: int, chunks: int) -> np.ndarray:
    return np.arange(chunks * CHUNK) + seq * 100_000


def engine(d, model: str = "m", raise_errors: bool = False):
    client = kvd_client.KvdClient(runtime_dir=str(d.runtime_dir), raise_errors=raise_errors).connect()
    pool = kvd_client.SharedKVPool(*GEOMETRY)
    client.register_kv(pool, model=model)
    return client, pool


def store(client, seq: int, chunks: int, tenant: str | None = None) -> int:
    """Store ``chunks`` chunks of sequence ``seq``, salted and labelled ``tenant``."""
    return client.store(tokens(seq, chunks), np.arange(chunks * 4), salt=tenant, tenant=tenant)


def lookup(client, seq: int, chunks: int, tenant: str | None = None) -> int:
    return client.lookup(tokens(seq, chunks), salt=tenant) // CHUNK


def groups(stats: dict) -> dict:
    q = stats["quotas"]
    return {(g["model"], g["tenant"]): g for g in [*q["groups"], q["other"]]}


def test_a_capped_tenant_evicts_only_its_own_chunks_and_says_so(start_daemon):
    pytest.importorskip("prometheus_client")
    port = free_port()
    d = start_daemon(host_capacity="64KiB", metrics_port=port,
                     quota='[{tenant = "a", host_max = "16KiB"}]')  # 8 of the tier's 32 chunks
    client, pool = engine(d)
    try:
        assert store(client, 1, 8, "a") == 8 * CHUNK  # a's cap, reached
        assert store(client, 2, 8, "b") == 8 * CHUNK
        assert store(client, 3, 8, "a") == 8 * CHUNK  # room in the tier, none under a's cap
        assert lookup(client, 1, 8, "a") == 0 and lookup(client, 3, 8, "a") == 8
        assert lookup(client, 2, 8, "b") == 8  # b lost nothing
        stats = d.stats()
        a, other = groups(stats)["*", "a"], groups(stats)["(other)", "(other)"]
        assert (a["host_used_bytes"], a["host_evictions"], a["host_max_bytes"]) == \
            (8 * CHUNK_BYTES, 8, 16384)
        assert (other["host_used_bytes"], other["host_evictions"]) == (8 * CHUNK_BYTES, 0)
        assert stats["tiers"]["host"]["evictions"] == 8
        m = scrape(port)
        assert value(m, "kvd_quota_used_bytes", model="*", tenant="a", tier="host") == 16384
        assert value(m, "kvd_quota_evictions_total", model="*", tenant="a", tier="host") == 8
        assert value(m, "kvd_quota_limit_bytes", model="*", tenant="a", limit="host_max") == 16384
        assert value(m, "kvd_quota_used_bytes", model="(other)", tenant="(other)", tier="host") == 16384
        cli = [sys.executable, "-m", "kvd", "stats", "--runtime-dir", str(d.runtime_dir)]
        table = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
        assert "quota * / a: host 16.0 KiB of 16.0 KiB, 8 evicted, 0 refused" in table
        shown = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True,
                                          check=True).stdout)
        assert shown["quotas"]["groups"][0]["host_evictions"] == 8
    finally:
        client.close()
        pool.close()


def test_a_reservation_keeps_other_stores_from_evicting_a_tenant(start_daemon):
    d = start_daemon(host_capacity="32KiB", quota='[{tenant = "b", host_reserve = "8KiB"}]')
    client, pool = engine(d)
    try:
        assert store(client, 1, 4, "b") == 4 * CHUNK  # b's reservation, and its oldest chunks
        assert store(client, 2, 6) == store(client, 3, 6) == 6 * CHUNK  # the tier is full
        assert store(client, 4, 6) == 6 * CHUNK  # evicts 6, none of b's
        assert lookup(client, 1, 4, "b") == 4
        assert lookup(client, 2, 6) == 0 and lookup(client, 3, 6) == lookup(client, 4, 6) == 6
        g = groups(d.stats())
        assert g["*", "b"]["host_evictions"] == 0 and g["(other)", "(other)"]["host_evictions"] == 6
    finally:
        client.close()
        pool.close()


def test_a_model_whose_chunks_are_all_leased_gets_over_quota_and_loses_nothing(start_daemon):
    pytest.importorskip("prometheus_client")
    port = free_port()
    d = start_daemon(host_capacity="64KiB", metrics_port=port,
                     quota='[{model = "m", host_max = "8KiB"}]')
    client, pool = engine(d, "m")
    strict, strict_pool = engine(d, "m", raise_errors=True)
    other, other_pool = engine(d, "n")
    try:
        assert store(client, 1, 4) == 4 * CHUNK
        hits, lease = client.lookup_lease(tokens(1, 4), 60_000)
        assert hits == 4 * CHUNK
        before = d.stats()
        assert store(client, 2, 1) == 0  # refused: a miss for this client
        with pytest.raises(kvd_client.OverQuota, match="quota of model m tenant \\*") as err:
            store(strict, 2, 1)
        assert err.value.code == "over_quota" and isinstance(err.value, kvd_client.NoSpace)
        after = d.stats()
        host = ("used_bytes", "chunks", "entries", "evictions")
        assert [after["tiers"]["host"][k] for k in host] == [before["tiers"]["host"][k] for k in host]
        assert after["errors"] - before["errors"] == 2
        assert groups(after)["m", "*"]["host_refused"] == 2
        m = scrape(port)
        assert value(m, "kvd_quota_refusals_total", model="m", tenant="*", tier="host") == 2
        assert value(m, "kvd_request_errors_total", op="store", code="over_quota") == 2
        assert lookup(client, 1, 4) == 4
        assert store(other, 3, 4) == 4 * CHUNK  # another model: not capped
        client.release(lease)
        assert store(client, 2, 1) == CHUNK  # now one of m's own chunks goes
        assert groups(d.stats())["m", "*"]["host_evictions"] == 1
    finally:
        for c in (client, strict, other):
            c.close()
        for p in (pool, strict_pool, other_pool):
            p.close()


def test_a_disk_cap_deletes_a_tenants_oldest_files_or_refuses_its_demotions(start_daemon, tmp_path):
    rules = '[{tenant = "a", disk_max = "24KiB"}, {tenant = "c", disk_max = "4KiB"}]'
    d = start_daemon(disk_dir=str(tmp_path / "disk"), disk_capacity="1MiB", quota=rules)
    client, pool = engine(d)
    try:
        assert store(client, 1, 6, "a") == 6 * CHUNK
        assert store(client, 2, 3, "b") == 3 * CHUNK
        assert store(client, 3, 2, "c") == 2 * CHUNK  # a file (8 KiB) is over c's cap
        d.control("flush_disk")  # a's first 3 fill its cap; its host chunks keep their files
        g = groups(d.stats())
        a, c, other = g["*", "a"], g["*", "c"], g["(other)", "(other)"]
        assert (a["disk_used_bytes"], a["disk_evictions"], a["disk_refused"]) == (3 * FILE_BYTES, 0, 3)
        assert (c["disk_used_bytes"], c["disk_refused"]) == (0, 2)
        assert other["disk_used_bytes"] == 3 * FILE_BYTES
        d.control("clear")  # every host copy gone: a's files are its chunks' only copies now
        assert store(client, 4, 3, "a") == 3 * CHUNK
        d.control("flush_disk")  # each of these replaces one of a's oldest files
        stats = d.stats()
        a = groups(stats)["*", "a"]
        assert (a["disk_used_bytes"], a["disk_evictions"], a["disk_refused"]) == (3 * FILE_BYTES, 3, 3)
        assert stats["tiers"]["disk"]["chunks"] == 6
        d.control("clear")
        assert lookup(client, 1, 6, "a") == 0 and lookup(client, 4, 3, "a") == 3  # from disk
        assert lookup(client, 2, 3, "b") == 3
    finally:
        client.close()
        pool.close()


@pytest.mark.parametrize("how, line", [
    ('file', "kvd: config error: quota: entry 2: host_reserve 2GiB is more than its host_max "
             "1GiB (from {file})"),
    ('flag', "kvd: config error: quota: entry 1: host_max: '8G' is ambiguous: write 8GiB "
             "(powers of 1024) or 8GB (powers of 1000) (from command line)"),
    ('sum', "kvd: config error: quota: the host_reserve values of all quotas add up to 2GiB, "
            "more than host_capacity 1GiB"),
])
def test_a_bad_quota_stops_start_up_with_one_line(tmp_path, how, line):
    conf = tmp_path / "kvd.toml"
    conf.write_text('chunk_tokens = 16\n\n[[quota]]\nmodel = "m"\nhost_max = "1GiB"\n\n'
                    '[[quota]]\ntenant = "t"\nhost_max = "1GiB"\n'
                    + ('host_reserve = "2GiB"\n' if how == "file" else ""))
    cmd = [sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(tmp_path / "run"),
           "--config", str(conf)]
    if how == "flag":
        cmd += ["--quota", '[{tenant = "a", host_max = "8G"}]']
    if how == "sum":
        cmd += ["--quota", '[{model = "m", host_reserve = "1GiB"}, {tenant = "t", '
                           'host_reserve = "1GiB"}]']
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [line.format(file=conf)]
    assert not (tmp_path / "run").exists()
    resolved = subprocess.run([sys.executable, "-m", "kvd", "config", "--resolved", "--config",
                               str(conf)], capture_output=True, text=True, timeout=60)
    if how != "file":
        assert 'quota = [{model = "m", host_max = "1GiB"}, {tenant = "t", host_max = "1GiB"}]' \
            "  # file" in resolved.stdout


def test_a_quota_binding_a_user_nobody_has_stops_start_up_with_one_line(tmp_path):
    cmd = [sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(tmp_path / "run"),
           "--chunk-tokens", "16", "--quota", '[{tenant = "a", users = ["no-such-user-kvd"]}]']
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].endswith(
        "config error: quota: users: no such user 'no-such-user-kvd'"), out.stderr
    assert "Traceback" not in out.stderr
