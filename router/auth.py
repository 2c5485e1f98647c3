"""Bearer-key authentication, keys read once at start-up from an environment mapping.

Rules (documented in docs/OPERATIONS.md terms):

- API keys (``router.api_keys_env``, comma-separated) guard ``/v1/*`` and ``/generate``.
- Admin keys (``router.admin_keys_env``) guard the admin routes (``/replicas*``, ``/admin/*``)
  and are also accepted wherever an API key is.
- Only API keys configured: admin routes need an API key too, so turning auth on never
  leaves drain/undrain open to anyone who can reach the port.
- Nothing configured: no auth (meant for loopback).
- ``/health`` and ``/metrics`` are always open (probes and scrapers carry no keys).

Comparison is constant-time (``hmac.compare_digest``); keys are never logged or echoed.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

from router.errors import Forbidden, Unauthorized


def _parse(value: str | None) -> tuple[bytes, ...]:
    if not value:
        return ()
    return tuple(k.strip().encode() for k in value.split(",") if k.strip())


def _matches(given: bytes, keys: tuple[bytes, ...]) -> bool:
    # Compare against every key (no early exit) so timing says nothing about which matched.
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


@dataclass(frozen=True)
class Keys:
    # Out of repr, so a log line or a traceback showing the object does not show the keys.
    api: tuple[bytes, ...] = field(default=(), repr=False)
    admin: tuple[bytes, ...] = field(default=(), repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str], api_env: str, admin_env: str) -> Keys:
        return cls(api=_parse(env.get(api_env)), admin=_parse(env.get(admin_env)))

    @property
    def enabled(self) -> bool:
        return bool(self.api or self.admin)

    def check(self, authorization: str | None, *, admin: bool) -> None:
        """Raise Unauthorized/Forbidden unless the header carries a key good for this route."""
        if not self.enabled:
            return
        given = _bearer(authorization)
        if given is None:
            raise Unauthorized("missing API key: send 'Authorization: Bearer KEY'")
        is_admin = _matches(given, self.admin)
        is_api = _matches(given, self.api)
        if admin:
            if is_admin or (not self.admin and is_api):
                return
            if is_api:
                raise Forbidden("this route needs an admin key")
            raise Unauthorized("invalid admin key")
        if is_api or is_admin:
            return
        raise Unauthorized("invalid API key")


def _bearer(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode()
