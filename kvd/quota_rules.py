"""The ``quota`` knob: its rules, parsed from TOML or text, checked, and written back.

A rule caps and/or reserves bytes of one group of chunks (a ``model``, a ``tenant``, or
both): ``host_max``, ``disk_max``, and ``host_reserve`` kept against other groups'
eviction; ``users``/``groups`` bind its tenant label to peer credentials
(kvd.server.tenants). ``parse(value, text, max_tenant)`` returns a tuple of ``Quota`` or
raises ``ValueError`` naming the entry (from 1) and what is wrong; ``check`` checks against
other knobs; ``to_toml`` writes them back. Imports nothing of kvd's but kvd.sizes.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass

from kvd.sizes import parse_size, size_text

MAX_RULES = 256  # every rule is a metrics label pair: the cardinality stays the config's
SIZES = ("host_max", "host_reserve", "disk_max")
NAMES = ("model", "tenant")
BINDS = ("users", "groups")
EXAMPLE = '[{model = "meta-llama/Llama-3.1-8B", host_max = "8GiB"}]'


@dataclass(frozen=True)
class Quota:
    model: str = ""
    tenant: str = ""
    host_max: int = 0
    host_reserve: int = 0
    disk_max: int = 0
    users: tuple = ()  # names or numeric ids, as written: resolved at start-up
    groups: tuple = ()

    def describe(self) -> str:
        return " ".join(f"{k} {getattr(self, k)!r}" for k in NAMES if getattr(self, k))


def parse(value, text: bool, max_tenant: int) -> tuple:
    if text:
        value = _from_text(value)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of tables ([[quota]] in TOML), got {value!r}")
    if len(value) > MAX_RULES:
        raise ValueError(f"{len(value)} quotas; at most {MAX_RULES}")
    rules, seen = [], {}
    for i, item in enumerate(value, 1):
        rule = _rule(i, asdict(item) if isinstance(item, Quota) else item, max_tenant)
        if (rule.model, rule.tenant) in seen:
            raise ValueError(f"entries {seen[rule.model, rule.tenant]} and {i} are both for "
                             f"{rule.describe()}: merge them")
        seen[rule.model, rule.tenant] = i
        rules.append(rule)
    return tuple(rules)


def _from_text(text: str):
    try:
        return tomllib.loads(f"quota = {text}")["quota"]
    except tomllib.TOMLDecodeError:
        raise ValueError(f"expected a TOML array of inline tables such as {EXAMPLE}, "
                         f"got {text!r}") from None


def _rule(i: int, item, max_tenant: int) -> Quota:
    if not isinstance(item, dict):
        raise ValueError(f"entry {i}: expected a table, got {item!r}")
    unknown = sorted(set(item) - set(NAMES) - set(SIZES) - set(BINDS))
    if unknown:
        raise ValueError(f"entry {i}: unknown key {unknown[0]!r} (keys: "
                         f"{', '.join(NAMES + SIZES + BINDS)})")
    binds = {key: _ids(i, key, item.get(key, ())) for key in BINDS}
    for key in NAMES:
        if not isinstance(item.get(key, ""), str):
            raise ValueError(f"entry {i}: {key} must be a string, got {item[key]!r}")
    tenant = item.get("tenant", "")
    if len(tenant) > max_tenant or not tenant.isprintable():
        raise ValueError(f"entry {i}: tenant must be at most {max_tenant} printable characters "
                         f"(what stores can carry), got {tenant!r}")
    if not item.get("model") and not tenant:
        raise ValueError(f"entry {i}: name a model, a tenant or both")
    sizes = {}
    for key in SIZES:
        try:
            sizes[key] = parse_size(item.get(key, 0))
        except ValueError as exc:
            raise ValueError(f"entry {i}: {key}: {exc}") from None
        if sizes[key] < 0:
            raise ValueError(f"entry {i}: {key} must be >= 0, got {sizes[key]}")
    if any(binds.values()) and not tenant:
        raise ValueError(f"entry {i}: users and groups bind a tenant label: name the tenant")
    if not any(sizes.values()) and not any(binds.values()):
        raise ValueError(f"entry {i}: set host_max, host_reserve, disk_max, users or groups")
    if sizes["host_max"] and sizes["host_reserve"] > sizes["host_max"]:
        raise ValueError(f"entry {i}: host_reserve {size_text(sizes['host_reserve'])} is more "
                         f"than its host_max {size_text(sizes['host_max'])}")
    return Quota(item.get("model", ""), tenant, **sizes, **binds)


def _ids(i: int, key: str, value) -> tuple:
    """``users`` or ``groups``: a list of names or ids, kept as text."""
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, (str, int)) and not isinstance(v, bool) and str(v).strip() for v in value):
        raise ValueError(f"entry {i}: {key} must be a list of names or numeric ids, got {value!r}")
    return tuple(str(v).strip() for v in value)


def check(rules: tuple, host_capacity: int, disk_dir: str) -> None:
    """Rules that other knobs make impossible: ``ValueError``."""
    reserved = sum(r.host_reserve for r in rules)
    if reserved > host_capacity:
        raise ValueError(f"the host_reserve values of all quotas add up to {size_text(reserved)}, more "
                         f"than host_capacity {size_text(host_capacity)}")
    capped = next((i for i, r in enumerate(rules, 1) if r.disk_max), None)
    if capped is not None and not disk_dir:
        raise ValueError(f"entry {capped}: disk_max needs a disk tier: set disk_dir")


def to_toml(rules: tuple) -> str:
    """``rules`` as a TOML array of inline tables (unset keys left out)."""
    return "[" + ", ".join("{" + ", ".join(_pair(r, k) for k in NAMES + SIZES + BINDS
                                           if getattr(r, k))
                           + "}" for r in rules) + "]"


def _pair(rule: Quota, key: str) -> str:
    value = getattr(rule, key)
    if key in SIZES:
        text = size_text(value)
        return f"{key} = {text}" if text.isdigit() else f'{key} = "{text}"'
    if key in BINDS:
        return f"{key} = [{', '.join(json.dumps(v) for v in value)}]"
    return f"{key} = {json.dumps(value)}"  # a TOML basic string, as config.toml_value writes
