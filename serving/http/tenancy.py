"""Who a request is: the tenant its bearer key belongs to, and what that tenant may do.

A **tenant** is the owner of one or more API keys. ``api_keys`` entries are ``KEY`` or
``NAME:KEY`` (the first ``:`` splits them; a name is 1-64 letters, digits or ``_.-``):

- a named key's tenant is ``NAME``: several keys with one name are one tenant (rotate a key by
  adding the new one under the same name, then removing the old one);
- an unnamed key's tenant is ``key-`` and the first 12 hex digits of the key's sha256, so the
  tenant id never reveals the key (it can go to logs, records and the past-sessions scope).

Permissions, by tenant id (``*``: every tenant):

- ``route_tenants`` may send ``cluster`` (override routing); default ``["*"]``;
- ``admin_tenants`` may read the replica's operational views (``GET /v1/policy``); default none.

With no keys configured there is no authentication and one tenant, :data:`ANONYMOUS`, that
may route and is admin (the single-user, loopback case). The HTTP layer resolves the tenant
once, in ``specops.serving.http.api.Gate``, puts it in the ASGI scope's state and passes its id down
to :meth:`specops.serving.http.server.ServingState.plan`; nothing below reads the key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A tenant name given in ``api_keys`` (``NAME:KEY``)."""
EVERY = "*"
"""In ``route_tenants`` / ``admin_tenants``: every tenant."""
MIN_KEY_CHARS = 8


@dataclass(frozen=True)
class Tenant:
    """The owner of a request's key: its id (never the key) and its permissions."""

    id: str
    may_route: bool
    """May send ``cluster`` (choose the cluster instead of the router)."""
    admin: bool
    """May read the replica's operational views (``GET /v1/policy``)."""


ANONYMOUS = Tenant("anonymous", may_route=True, admin=True)
"""The one tenant of a server without keys."""


def split_key(entry: str) -> tuple[str, str]:
    """``(tenant id, key)`` of one ``api_keys`` entry: ``NAME:KEY`` or a bare ``KEY``."""
    name, sep, key = entry.partition(":")
    if sep and NAME.fullmatch(name):
        return name, key
    return anonymous_id(entry), entry


def anonymous_id(key: str) -> str:
    """The id of an unnamed key's tenant: ``key-`` + 12 hex digits of its sha256 (not reversible)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class Tenants:
    """The key -> tenant table of one server (built once from the config)."""

    def __init__(
        self, api_keys: Iterable[str] = (), route_tenants: Iterable[str] = (EVERY,), admin_tenants: Iterable[str] = ()
    ) -> None:
        self._keys = [(key.encode(), tid) for tid, key in map(split_key, api_keys)]
        self.ids = frozenset(tid for _, tid in self._keys)
        route, admin = frozenset(route_tenants), frozenset(admin_tenants)
        self._tenants = {
            tid: Tenant(tid, may_route=EVERY in route or tid in route, admin=EVERY in admin or tid in admin)
            for tid in self.ids
        }

    @classmethod
    def from_config(cls, cfg) -> Tenants:
        """From the API section (``specops.serving.http.config.ApiConfig``: ``api_keys``, ``route_tenants``, ``admin_tenants``)."""
        return cls(cfg.api_keys, cfg.route_tenants, cfg.admin_tenants)

    @property
    def required(self) -> bool:
        """Whether requests must send a key (some key is configured)."""
        return bool(self._keys)

    def lookup(self, token: bytes) -> Tenant | None:
        """The tenant of a presented key, or None when no key matches (every key is compared,
        in constant time each)."""
        found = None
        for key, tid in self._keys:
            if hmac.compare_digest(token, key):
                found = tid
        return self._tenants[found] if found is not None else None


def check_config(api_keys: list[str], route_tenants: list[str], admin_tenants: list[str]) -> None:
    """Refuse an ``api_keys`` entry whose key is too short, and a permission list naming a
    tenant no key belongs to (a typo there would silently deny). ``ValueError`` says what to change."""
    if any(len(split_key(e)[1]) < MIN_KEY_CHARS for e in api_keys):
        raise ValueError(f"api_keys must be at least {MIN_KEY_CHARS} characters each (the key after NAME: when named)")
    if not api_keys:
        return
    ids = {split_key(e)[0] for e in api_keys}
    for field, names in (("route_tenants", route_tenants), ("admin_tenants", admin_tenants)):
        unknown = sorted(set(names) - ids - {EVERY})
        if unknown:
            raise ValueError(
                f"{field} names {', '.join(map(repr, unknown))}, which no api_keys entry names: name a "
                "key's tenant as NAME:KEY in api_keys, or use '*' for every tenant"
            )
