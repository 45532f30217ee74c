"""Tier attach preflight: checked on the API side before the engine is asked to attach a tier.

A remote store must answer before it is attached; asking here, on the event loop, keeps the step
loop from ever waiting on the network.
"""

from __future__ import annotations

from typing import Any

from cache.tiers import factory
from engine.config import EngineConfig
from engine.errors import InvalidRequestError


async def preflight_attach(config: EngineConfig, tier: str, options: dict[str, Any]) -> None:
    """Raise ``InvalidRequestError`` when tier ``tier`` cannot be attached with ``options``.

    A tier kind that `cache.tiers.factory` does not know passes: the engine gives the reason.
    The engine validates the options again, with the same model, when it builds the tier.
    """
    if tier not in factory.KINDS:
        return
    try:
        chosen = factory.validate(tier, config.tier_options().get(tier, {}), options)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="tier") from None
    problem = await factory.preflight(tier, chosen)
    if problem is not None:
        raise InvalidRequestError(f"{problem}; not attached", param="tier")
