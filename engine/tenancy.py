"""Tenant quotas, handed from a request to the device ledger and to every tier below it.

A tenant's salt and quotas reach the engine as plain fields of a request (`GenerateRequest`);
this adapter remembers the latest quota of each tenant that sent one and gives it to whatever
holds blocks — the device pool's ledger and each attached tier, again whenever a tier attaches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from cache.quota import QuotaLedger


def owner_tag(tenant: str, salt: bytes) -> str:
    """The name a shared store keeps a tenant's quota under: only this server's secret (through
    the tenant's salt) links it to the tenant, so the store never learns the tenant's name."""
    return hashlib.blake2b(tenant.encode(), key=salt[:64], digest_size=12, person=b"kvgate-owner").hexdigest()


class TenantQuotas:
    """The latest block quota per tier of each tenant (tier name → blocks; absent = unlimited)."""

    def __init__(self, ledger: QuotaLedger) -> None:
        self._ledger = ledger
        self._quotas: dict[str, tuple[dict[str, int], bytes]] = {}  # tenant → (quota per tier, salt)

    def update(self, tenant: str, quota: Mapping[str, int], salt: bytes, tiers: Iterable[Any]) -> None:
        """Record a request's quota and apply it. A request without one leaves a tenant that never
        had one unlimited, and sets an earlier one's quota back to unlimited."""
        if not tenant or not (quota or tenant in self._quotas):
            return
        self._quotas[tenant] = (dict(quota), salt)
        self._apply(tenant, tiers)

    def reapply(self, tiers: Iterable[Any]) -> None:
        """Give every known tenant's quota to ``tiers`` (after one attaches)."""
        tiers = list(tiers)
        for tenant in self._quotas:
            self._apply(tenant, tiers)

    def _apply(self, tenant: str, tiers: Iterable[Any]) -> None:
        quota, salt = self._quotas[tenant]
        self._ledger.set_limit(tenant, quota.get("device"))
        tag = owner_tag(tenant, salt)
        for tier in tiers:
            tier.apply_quota(tenant, tag, quota.get(tier.name))
