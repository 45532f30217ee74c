"""The prefill side of a Disaggregated-Pipeline (`[server] role = "prefill"`): a response ends only
once the shared store holds every block of its prompts that a decode replica can reuse, so the
router sends the decode leg when its prefix is there to load (docs/disaggregated.md).

The engine writes a prefill replica's blocks through to the store as it computes them; this asks
the store, through the cache control API's lookup (one EXISTS pipeline, off the step loop),
until every reusable block of each prompt is present or ``SHIP_TIMEOUT_S`` passes. Past the
deadline the response goes out anyway (the decode replica recomputes what it cannot load: same
tokens, more time) and the miss is counted and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.cache_control import CacheCommand
from tenants.registry import Tenant

logger = logging.getLogger(__name__)

SHIP_TIMEOUT_S = 5.0
_POLL_S = 0.005


@dataclass(slots=True)
class ShipCounters:
    waited: int = 0  # prompts whose blocks a response waited for
    wait_s: float = 0.0
    late: int = 0  # prompts whose blocks were not all in the store by the deadline


async def shared_tier(state: Any, engine: Any, refresh: bool = False) -> str | None:
    """The name of the engine's shared tier (the one whose traits say ``shared``), or None: read
    from a full engine snapshot once, then remembered (``refresh``: read again, after a lookup
    answer stopped naming it: the tier was detached or another attached)."""
    if refresh or not hasattr(state, "shared_tier"):
        tiers = (await engine.stats()).get("tiers", {})
        state.shared_tier = next((name for name, t in tiers.items()
                                  if isinstance(t, dict) and t.get("traits", {}).get("shared")), None)
    return state.shared_tier


async def await_shipped(state: Any, engine: Any, tenant: Tenant, prompts: list[list[int]],
                        cache_salt: str | None, public_lens: list[int]) -> None:
    """Return once the shared store holds every reusable block of each prompt (or at the deadline)."""
    counters: ShipCounters = state.ship_counters
    shared = await shared_tier(state, engine)
    if shared is None:
        return
    size = state.settings.cache.block_size
    t0 = time.monotonic()
    for ids, public_len in zip(prompts, public_lens, strict=True):
        want = (len(ids) - 1) // size  # the last token is always computed: its block is never reused
        if want <= 0:
            continue
        command = CacheCommand(op="lookup", tenant=tenant.name, namespace_salt=tenant.salt,
                               prompt_token_ids=tuple(ids), cache_salt=cache_salt, public_prefix_len=public_len,
                               public_salt=state.registry.public_salt)
        counters.waited += 1
        while True:
            try:
                answer = await engine.cache_control(command)
            except (asyncio.TimeoutError, RuntimeError) as exc:  # the engine is stopping or stuck
                logger.warning("prefill: could not ask the engine whether a prompt's blocks are stored (%s)", exc)
                counters.late += 1
                break
            if answer.get("ok") and shared not in answer.get("blocks", {}):  # the tiers changed
                shared = await shared_tier(state, engine, refresh=True)
                if shared is None:
                    return
            if answer.get("ok") and answer.get("blocks", {}).get(shared, 0) >= want:
                break
            if time.monotonic() - t0 > SHIP_TIMEOUT_S:
                counters.late += 1
                logger.warning("prefill: %d of %d blocks of a prompt in the shared store after %.1f s; answering "
                               "anyway (the decode replica recomputes the rest)",
                               answer.get("blocks", {}).get(shared, 0), want, SHIP_TIMEOUT_S)
                break
            await asyncio.sleep(_POLL_S)
    counters.wait_s += time.monotonic() - t0
