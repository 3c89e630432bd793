"""Tenant labels bound to peer credentials: the ``users`` and ``groups`` of ``quota`` rules.

``TenantBindings(rules)`` resolves every rule's ``users`` and ``groups`` to ids at start-up
(an unknown name: ``ConfigError``, exit 2). ``check(label, cred)`` raises ``Forbidden`` for a
store whose ``tenant`` label a rule binds unless the connection's kernel credentials are
among its users or groups (gid or supplementary groups, read as kvd.server.peers reads
them); without credentials a bound label is refused. Unbound labels pass. Decisions are
cached per (credentials, label), at most ``CACHED``.
"""

from __future__ import annotations

import grp
import pwd

from kvd.server.peers import process_groups
from kvd_protocol.errors import ConfigError, Forbidden

CACHED = 4096


class TenantBindings:
    def __init__(self, rules: tuple):
        self.users: dict[str, set[int]] = {}  # label -> uids that may carry it
        self.groups: dict[str, set[int]] = {}  # label -> gids whose members may
        for rule in rules:
            if rule.users or rule.groups:
                self.users.setdefault(rule.tenant, set()).update(map(_uid, rule.users))
                self.groups.setdefault(rule.tenant, set()).update(map(_gid, rule.groups))
        self._decided: dict = {}

    def __bool__(self) -> bool:
        return bool(self.users)

    def check(self, label: str | None, cred) -> None:
        if label is None or label not in self.users:
            return
        key = (cred, label)
        allowed = self._decided.get(key)
        if allowed is None:
            allowed = cred is not None and (
                cred.uid in self.users[label] or cred.gid in self.groups[label]
                or bool(self.groups[label] & process_groups(cred.pid)))
            if len(self._decided) >= CACHED:
                self._decided.clear()
            self._decided[key] = allowed
        if not allowed:
            who = "a peer without credentials" if cred is None else f"uid {cred.uid} gid {cred.gid}"
            raise Forbidden(f"tenant label {label!r} is bound to other users or groups (quota "
                            f"rules); {who} may not store under it")


def _uid(name: str) -> int:
    if name.isdigit():
        return int(name)
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise ConfigError("quota", f"users: no such user {name!r}") from None


def _gid(name: str) -> int:
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError("quota", f"groups: no such group {name!r}") from None
