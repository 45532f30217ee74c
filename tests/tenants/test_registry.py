"""Tenant registry: hashed keys, constant-time lookup, namespace salts, the persisted secret."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenants.registry import (
    ANONYMOUS,
    TenantRegistry,
    TenantSpec,
    key_digest,
    load_server_secret,
    namespace_salt,
)

SECRET = b"s" * 32


def _registry(admin_key: str | None = "adm") -> TenantRegistry:
    return TenantRegistry.build([
        TenantSpec("acme", ("sk-a1", "sk-a2"), quota={"device": 10}),
        TenantSpec("beta", ("sk-b",), share_group="team"),
        TenantSpec("gamma", ("sk-g",), share_group="team"),
    ], SECRET, admin_key)


def test_keys_resolve_to_their_tenant() -> None:
    registry = _registry()
    assert registry.authenticate("sk-a1").name == "acme"
    assert registry.authenticate("sk-a2").name == "acme"
    assert registry.authenticate("sk-b").name == "beta"
    assert registry.authenticate("sk-x") is None
    assert registry.authenticate("") is None and registry.authenticate(None) is None
    assert not registry.open and registry.get("acme").quota == {"device": 10}


def test_keys_are_kept_only_as_digests() -> None:
    registry = _registry()
    held = repr(vars(registry)) + repr(registry.tenants)
    assert "sk-a1" not in held and key_digest("sk-a1") in [d for d, _ in registry._key_digests]
    assert "salt" not in repr(registry.authenticate("sk-a1"))  # salts stay out of logs


def test_salts_separate_tenants_and_join_groups() -> None:
    registry = _registry()
    acme, beta, gamma = (registry.get(n) for n in ("acme", "beta", "gamma"))
    assert acme.namespace == "tenant:acme" and beta.namespace == gamma.namespace == "group:team"
    assert beta.salt == gamma.salt != acme.salt
    assert len(acme.salt) == 32 and acme.salt == namespace_salt(SECRET, "tenant:acme")
    assert registry.anonymous.salt not in (acme.salt, beta.salt)
    other = TenantRegistry.build([TenantSpec("acme", ("sk-a1",))], b"t" * 32)
    assert other.get("acme").salt != acme.salt  # a different server secret, different salts


def test_a_tenant_named_like_a_group_gets_another_namespace() -> None:
    registry = TenantRegistry.build([TenantSpec("team", ("k1",)), TenantSpec("x", ("k2",), share_group="team")],
                                    SECRET)
    assert registry.get("team").salt != registry.get("x").salt


def test_open_registry_is_anonymous() -> None:
    registry = TenantRegistry.build([], SECRET)
    assert registry.open and registry.authenticate(None).name == ANONYMOUS
    assert registry.authenticate("anything").name == ANONYMOUS
    assert registry.anonymous.salt == namespace_salt(SECRET, ANONYMOUS)
    assert registry.is_admin(None) and not registry.admin_protected


def test_admin_key() -> None:
    registry = _registry()
    assert registry.is_admin("adm") and not registry.is_admin("sk-a1") and not registry.is_admin(None)
    locked = _registry(admin_key=None)
    assert locked.admin_protected and not locked.is_admin("adm") and not locked.is_admin(None)
    open_with_key = TenantRegistry.build([], SECRET, "adm")
    assert not open_with_key.is_admin(None) and open_with_key.is_admin("adm")


@pytest.mark.parametrize(("specs", "message"), [
    ([TenantSpec("a", ("k",)), TenantSpec("a", ("j",))], "configured twice"),
    ([TenantSpec("a", ("k",)), TenantSpec("b", ("k",))], "also a key of tenant 'a'"),
    ([TenantSpec("a", ("adm",))], "equals the admin api_key"),
])
def test_conflicts_are_rejected(specs: list[TenantSpec], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TenantRegistry.build(specs, SECRET, "adm")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "", "api_keys": ("k",)}, "invalid"),
    ({"name": "has space", "api_keys": ("k",)}, "invalid"),
    ({"name": ANONYMOUS, "api_keys": ("k",)}, "invalid"),
    ({"name": "a", "api_keys": ()}, "no api_keys"),
    ({"name": "a", "api_keys": ("",)}, "empty api key"),
    ({"name": "a", "api_keys": ("k",), "quota": {"g p u": 1}}, "quota tier name"),
    ({"name": "a", "api_keys": ("k",), "quota": {"device": -1}}, ">= 0"),
])
def test_bad_specs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TenantSpec(**kwargs)


@settings(deadline=None)  # shared 2-core machines: no per-example timing
@given(st.text(min_size=1, max_size=40))
def test_only_configured_keys_authenticate(key: str) -> None:
    registry = _registry()
    tenant = registry.authenticate(key)
    expected = {"sk-a1": "acme", "sk-a2": "acme", "sk-b": "beta", "sk-g": "gamma"}.get(key)
    assert (tenant.name if tenant else None) == expected


def test_secret_from_config_then_env(tmp_path: Path) -> None:
    env = {"KVGATE_SECRET": "e" * 20, "KVGATE_CACHE_DIR": str(tmp_path)}
    assert load_server_secret("c" * 20, env) == b"c" * 20
    assert load_server_secret(None, env) == b"e" * 20
    with pytest.raises(ValueError, match="at least 16"):
        load_server_secret("short", env)
    assert not (tmp_path / "secret").exists()


def test_generated_secret_is_persisted_0600(tmp_path: Path) -> None:
    env = {"KVGATE_CACHE_DIR": str(tmp_path / "cache")}
    first = load_server_secret(None, env)
    path = tmp_path / "cache" / "secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_server_secret(None, env) == first and len(first) >= 32  # survives restarts
    assert os.listdir(path.parent) == ["secret"]  # no temp files left behind
    assert load_server_secret(None, {"KVGATE_CACHE_DIR": str(tmp_path / "other")}) != first
