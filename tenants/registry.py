"""Tenants: API keys → `Tenant(namespace, salt)`, and the admin key.

Keys are never kept in clear: the registry holds SHA-256 digests and compares them with
`secrets.compare_digest`, visiting every digest so the time taken does not reveal which tenant
(if any) a key belongs to.

Each tenant's KV namespace is salted with a server-side secret::

    namespace = "group:<share_group>"  if share_group else  "tenant:<name>"
    salt      = HMAC-SHA256(server secret, namespace)

so tenants that opt into the same sharing group hash their prefixes identically, and everyone
else can never produce the same block key. The anonymous tenant (no `[[tenants]]` configured) has
a salt of its own. The server secret comes from the config, else `KVGATE_SECRET`, else a random
secret generated once and persisted (mode 0600) so that salts, and thus persisted KV blocks,
survive restarts. The same secret keys the MACs of records in the shared store
(`store_mac_key`), under a domain of its own.

This package imports nothing from `app`, `engine` or `cache`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tenants.limits import TenantLimits

logger = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
PUBLIC_NAMESPACE = "public"  # tenants are "tenant:<name>", groups "group:<name>": no collision
MIN_SECRET_LEN = 16
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SALT_DOMAIN = b"kvgate-namespace-v1\x00"
_STORE_MAC_DOMAIN = b"kvgate-store-mac-v1\x00"  # not a namespace prefix: the key never equals a salt


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request runs as: its name, KV namespace, namespace salt, per-tier block quotas and
    admission limits.

    `quota` maps a tier name to the most blocks the tenant may hold there; a missing tier is
    unlimited. `limits` are its request rate, token rate and concurrency (`tenants.limits`).
    """

    name: str
    namespace: str
    salt: bytes = field(repr=False)
    share_group: str = ""
    quota: Mapping[str, int] = field(default_factory=dict)
    limits: TenantLimits = TenantLimits()


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One `[[tenants]]` entry of the configuration, before keys are hashed."""

    name: str
    api_keys: tuple[str, ...]
    share_group: str = ""
    quota: Mapping[str, int] = field(default_factory=dict)
    limits: TenantLimits = TenantLimits()

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name) or self.name == ANONYMOUS:
            raise ValueError(
                f"tenant name {self.name!r} is invalid: use 1-64 letters, digits, '_', '.', '-' "
                f"(and not {ANONYMOUS!r})"
            )
        if not self.api_keys:
            raise ValueError(f"tenant {self.name!r} has no api_keys")
        if any(not isinstance(key, str) or not key for key in self.api_keys):
            raise ValueError(f"tenant {self.name!r} has an empty api key")
        if self.share_group and not _NAME_RE.match(self.share_group):
            raise ValueError(f"tenant {self.name!r}: share_group {self.share_group!r} is invalid")
        for tier, blocks in self.quota.items():
            # which tiers exist is the engine's to say ([tenants.quota] in the settings names them)
            if not isinstance(tier, str) or not _NAME_RE.match(tier):
                raise ValueError(f"tenant {self.name!r}: quota tier name {tier!r} is invalid")
            if not isinstance(blocks, int) or blocks < 0:
                raise ValueError(f"tenant {self.name!r}: quota.{tier} must be an integer >= 0")


def key_digest(api_key: str) -> bytes:
    """SHA-256 digest of an API key: the only form in which keys are kept."""
    return hashlib.sha256(api_key.encode("utf-8")).digest()


def namespace_salt(secret: bytes, namespace: str) -> bytes:
    """HMAC-SHA256 of a namespace under the server secret (32 bytes)."""
    return hmac.new(secret, _SALT_DOMAIN + namespace.encode("utf-8"), hashlib.sha256).digest()


def store_mac_key(secret: bytes) -> bytes:
    """The key that seals records in the shared store (32 bytes): HMAC-SHA256 of the server
    secret under its own domain, so replicas that share the secret accept each other's blocks
    and nobody without it can write one they accept (cache/tiers/store_mac.py)."""
    return hmac.new(secret, _STORE_MAC_DOMAIN, hashlib.sha256).digest()


def default_secret_path(env: Mapping[str, str] | None = None) -> Path:
    """`$KVGATE_CACHE_DIR/secret`, else `~/.cache/kvgate/secret`."""
    env = os.environ if env is None else env
    base = env.get("KVGATE_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "kvgate"
    return root / "secret"


def load_server_secret(configured: str | None = None, env: Mapping[str, str] | None = None,
                       path: Path | None = None) -> bytes:
    """The server secret: `configured`, else `$KVGATE_SECRET`, else the persisted one.

    A persisted secret is created on first use with 32 random bytes, written atomically with
    mode 0600, so concurrent first starts agree on one secret.
    """
    env = os.environ if env is None else env
    for origin, value in (("[server] secret", configured), ("KVGATE_SECRET", env.get("KVGATE_SECRET"))):
        if value:
            if len(value) < MIN_SECRET_LEN:
                raise ValueError(f"{origin} must be at least {MIN_SECRET_LEN} characters long")
            return value.encode("utf-8")
    path = default_secret_path(env) if path is None else path
    return _read_or_create_secret(path)


def _read_or_create_secret(path: Path) -> bytes:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".secret-")  # mkstemp: mode 0600
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_hex(32) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)  # fails if another process won the race: use theirs
                logger.info("generated server secret path=%s", path)
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    if path.stat().st_mode & 0o077:
        logger.warning("server secret file is readable by others path=%s (chmod 600 it)", path)
    value = path.read_text().strip()
    if len(value) < MIN_SECRET_LEN:
        raise ValueError(f"server secret file {path} is shorter than {MIN_SECRET_LEN} characters")
    return value.encode("utf-8")


class TenantRegistry:
    """Resolves bearer keys to tenants and checks the admin key, in constant time per key."""

    def __init__(self, tenants: Iterable[Tenant], key_digests: Iterable[tuple[bytes, Tenant]],
                 anonymous: Tenant, admin_digest: bytes | None, public_salt: bytes = b"") -> None:
        self._tenants = {tenant.name: tenant for tenant in tenants}
        self._key_digests = list(key_digests)
        self.anonymous = anonymous
        self._admin_digest = admin_digest
        self.public_salt = public_salt  # the namespace of public prefixes (tenants.public), shared by all

    @classmethod
    def build(cls, specs: Iterable[TenantSpec], secret: bytes, admin_key: str | None = None) -> TenantRegistry:
        """Hash every key, derive every salt; reject duplicate names and keys shared by tenants."""
        tenants: list[Tenant] = []
        digests: list[tuple[bytes, Tenant]] = []
        seen_keys: dict[bytes, str] = {}
        admin_digest = key_digest(admin_key) if admin_key else None
        for spec in specs:
            if any(t.name == spec.name for t in tenants):
                raise ValueError(f"tenant {spec.name!r} is configured twice")
            namespace = f"group:{spec.share_group}" if spec.share_group else f"tenant:{spec.name}"
            tenant = Tenant(spec.name, namespace, namespace_salt(secret, namespace),
                            spec.share_group, dict(spec.quota), spec.limits)
            tenants.append(tenant)
            for key in spec.api_keys:
                digest = key_digest(key)
                if digest in seen_keys and seen_keys[digest] != spec.name:
                    raise ValueError(f"an api key of tenant {spec.name!r} is also a key of "
                                     f"tenant {seen_keys[digest]!r}")
                if admin_digest is not None and hmac.compare_digest(digest, admin_digest):
                    raise ValueError(f"an api key of tenant {spec.name!r} equals the admin api_key")
                seen_keys[digest] = spec.name
                digests.append((digest, tenant))
        anonymous = Tenant(ANONYMOUS, ANONYMOUS, namespace_salt(secret, ANONYMOUS))
        return cls(tenants, digests, anonymous, admin_digest, namespace_salt(secret, PUBLIC_NAMESPACE))

    @property
    def open(self) -> bool:
        """True when no tenants are configured: every caller is the anonymous tenant."""
        return not self._tenants

    @property
    def tenants(self) -> list[Tenant]:
        return list(self._tenants.values())

    def get(self, name: str) -> Tenant | None:
        return self.anonymous if name == ANONYMOUS and self.open else self._tenants.get(name)

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The tenant owning `api_key`; the anonymous tenant when open; None if unknown."""
        if self.open:
            return self.anonymous
        if not api_key:
            return None
        digest = key_digest(api_key)
        found: Tenant | None = None
        for candidate, tenant in self._key_digests:  # no early exit: constant time per key
            if secrets.compare_digest(candidate, digest):
                found = tenant
        return found

    @property
    def admin_protected(self) -> bool:
        """Whether `/admin/*` needs a key: always once an admin key or any tenant is configured."""
        return self._admin_digest is not None or not self.open

    def is_admin(self, api_key: str | None) -> bool:
        """Whether `api_key` grants admin access (anyone may when nothing is configured)."""
        if not self.admin_protected:
            return True
        if self._admin_digest is None or not api_key:
            return False
        return secrets.compare_digest(key_digest(api_key), self._admin_digest)
