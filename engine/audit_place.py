"""The isolation audit's own cache operation (`op = "place"`, app/audit.py): put a synthetic
tenant's prompt into one tier and into no tier above it, as traffic would have pushed it down,
so that the audit can probe that tier alone. Only the audit's tenants may ask for it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cache.tiers.control import drop_stores, may_land
from engine.cache_control import CacheCommand, Reply, is_audit_tenant, refusal

if TYPE_CHECKING:
    from engine.cache_control import CacheControl


def place(control: CacheControl, command: CacheCommand, reply: Reply) -> None:
    """Audit tenants only: make the prompt's blocks live in ``command.tier`` and in no tier
    above it, as traffic would have pushed them down. For host, idle device blocks go down as
    an eviction sends them (`Tiering.demote`); for a lower tier their bytes are written there
    and the copies above are dropped. Answers how many of the prompt's blocks the tier holds
    afterwards (``placed_blocks``); blocks a running request holds stay (``skipped_in_use``)."""
    if not is_audit_tenant(command.tenant):
        reply(refusal(403, "place is the isolation audit's own operation", "permission_denied"))
        return
    core, chain = control.core, control.core.chain
    below = list(chain.tiers) if chain is not None else []
    names = ["device", *(t.name for t in below)]
    if command.tier not in names:
        reply(refusal(400, f"no tier named {command.tier!r} is attached (attached: {', '.join(names)})",
                      "unknown_tier", "tier"))
        return
    depth = names.index(command.tier)
    keys, _ = control._hashes(command)
    pool, memory = core.manager.pool, chain.memory if chain is not None else None
    host_depth = names.index(memory.name) if memory is not None else len(names)
    payloads: dict[bytes, bytes] = {}
    in_use = 0
    for key in keys:
        block = pool.get_cached_block(key)
        if block is not None and depth > 0:
            if block.ref_cnt > 0:
                in_use += 1
                continue
            if depth == host_depth:
                core.tiers.demote(block, key)  # into host; what it evicts there goes further down
            else:
                payloads[key] = core.storage.read_block(block.slot)
            pool.drop(key)
        if memory is not None and depth > host_depth and key in memory:
            payload = memory.payload(key)
            if payload is not None:
                payloads.setdefault(key, payload)
            memory.delete(key)
    if depth <= host_depth:
        held = sum(1 for k in keys if (control._on_device(k) if depth == 0 else memory is not None and k in memory))
        reply({"ok": True, "tier": command.tier, "placed_blocks": held, "skipped_in_use": in_use})
        return
    assert chain is not None and chain.io is not None
    target, io = below[depth - 1], chain.io
    above = [store for store in chain.stores if names.index(store.name) < depth]
    settle = [k for k in keys if may_land(chain, k)]

    async def down() -> dict[str, Any]:
        if above:
            await drop_stores(chain, above, keys, settle)
        if target is chain.shared:
            await target.put(list(payloads.items()), command.tenant)
            held = sum(await target.exists(keys))
        else:
            for key, payload in payloads.items():
                await target.write(key, payload, command.tenant, executor=io.writer)
            held = sum(1 for k in keys if k in target)
        return {"ok": True, "tier": target.name, "placed_blocks": held, "skipped_in_use": in_use}

    control._submit(down(), reply)

