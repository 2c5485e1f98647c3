"""Key rules: API keys for /v1, admin keys for admin routes, API keys as admin without them."""

from __future__ import annotations

import pytest

from router.auth import Keys
from router.errors import Forbidden, Unauthorized

ENV = {"API": "k1, k2", "ADMIN": "root"}


def keys(env: dict[str, str]) -> Keys:
    return Keys.from_env(env, "API", "ADMIN")


def test_no_keys_configured_means_open() -> None:
    k = keys({})
    assert not k.enabled
    k.check(None, admin=False)
    k.check(None, admin=True)


def test_api_routes_need_a_configured_key() -> None:
    k = keys(ENV)
    with pytest.raises(Unauthorized, match="missing"):
        k.check(None, admin=False)
    with pytest.raises(Unauthorized, match="missing"):
        k.check("Basic k1", admin=False)
    with pytest.raises(Unauthorized, match="invalid"):
        k.check("Bearer nope", admin=False)
    k.check("Bearer k1", admin=False)
    k.check("bearer k2", admin=False)
    k.check("Bearer root", admin=False)  # an admin key works everywhere


def test_admin_routes_need_the_admin_key() -> None:
    k = keys(ENV)
    with pytest.raises(Forbidden):
        k.check("Bearer k1", admin=True)
    with pytest.raises(Unauthorized):
        k.check("Bearer wrong", admin=True)
    with pytest.raises(Unauthorized):
        k.check(None, admin=True)
    k.check("Bearer root", admin=True)


def test_api_keys_guard_admin_routes_when_no_admin_key_is_set() -> None:
    k = keys({"API": "k1"})
    with pytest.raises(Unauthorized):
        k.check(None, admin=True)
    k.check("Bearer k1", admin=True)


def test_errors_never_contain_the_key() -> None:
    k = keys(ENV)
    for header, error in (("Bearer secret-guess", Unauthorized), ("Bearer k1", Forbidden)):
        with pytest.raises(error) as info:  # a refusal, whose message names no key
            k.check(header, admin=True)
        assert "secret-guess" not in str(info.value) and "k1" not in str(info.value)
    assert "k1" not in repr(k) and "root" not in repr(k)
