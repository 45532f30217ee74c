"""The shared store's MAC key: one per server secret, the same on every replica, never a salt."""

from __future__ import annotations

import hashlib
import hmac

from tenants.registry import (
    ANONYMOUS,
    PUBLIC_NAMESPACE,
    TenantRegistry,
    TenantSpec,
    namespace_salt,
    store_mac_key,
)

SECRET = b"s" * 32


def test_the_store_key_follows_the_secret_and_equals_no_salt() -> None:
    key = store_mac_key(SECRET)
    assert len(key) == 32 and key == store_mac_key(b"s" * 32)  # replicas sharing the secret agree
    assert key != store_mac_key(b"t" * 32)
    assert key == hmac.new(SECRET, b"kvgate-store-mac-v1\x00", hashlib.sha256).digest()
    registry = TenantRegistry.build([TenantSpec("acme", ("sk-a",), share_group="team")], SECRET)
    salts = {t.salt for t in registry.tenants} | {registry.anonymous.salt, registry.public_salt}
    assert key not in salts
    for namespace in ("", ANONYMOUS, PUBLIC_NAMESPACE, "store-mac", "kvgate-store-mac-v1\x00"):
        assert key != namespace_salt(SECRET, namespace)
