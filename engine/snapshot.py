"""What the engine reports about itself (`/admin/metrics`, Prometheus, the dashboard, tests): one
typed schema, serialised to plain JSON values at the process boundary.

`EngineSnapshot` is the top level; ``tiers`` holds `TierChain.snapshot()` (a ``chain`` entry of
counters, then one `cache.tiers.base.TierSnapshot` per attached tier), ``gaps`` the survey's
measured gaps and ``archetype`` `cache.archetype`'s answer (both documented in docs/metrics.md
and docs/archetype.md). Every field carries its meaning; ``python -m engine.snapshot`` prints
the schema as the Markdown table docs/metrics.md holds (a test keeps the two equal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from cache.archetype import classify, describe
from cache.tiers import factory
from cache.tiers.base import TierSnapshot

if TYPE_CHECKING:
    from engine.core import EngineCore


def _doc(text: str, default: Any = None) -> Any:
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True, slots=True)
class PrefixCacheSnapshot:
    lookups: int = _doc("prefix-cache lookups (one per admitted prompt)", 0)
    query_tokens: int = _doc("prompt tokens looked up (vLLM's prefix_cache_queries)", 0)
    hit_tokens: int = _doc("prompt tokens found in any tier (vLLM's prefix_cache_hits)", 0)
    lookup_time_s: float = _doc("time spent in index lookups", 0.0)
    evictions: int = _doc("device blocks whose cached prefix was evicted", 0)
    block_hits: int = _doc("device blocks reused from the prefix cache", 0)
    allocations: int = _doc("device blocks allocated", 0)
    cached: int = _doc("device blocks published under a prefix hash (a KV event `BlockStored` each)", 0)
    quota: dict[str, Any] = _doc("device quota ledger: per-owner blocks and limits", None)


@dataclass(frozen=True, slots=True)
class CacheControlSnapshot:
    pinned_blocks: dict[str, int] = _doc("blocks held by pins or prefetch protections, per tier holding them now "
                                         "(device, host, disk)", None)
    pinned_keys: int = _doc("blocks pinned until unpinned", 0)
    protected_keys: int = _doc("blocks held only by a prefetch's protection, until its TTL", 0)
    held_by_tenant: dict[str, int] = _doc("blocks each tenant holds pinned or protected", None)
    pin_limit: int = _doc("most blocks pins and protections may hold together (3/4 of the host tier)", 0)
    requests: dict[str, int] = _doc("cache control calls by operation: lookup, prefetch, pin, unpin, delete", None)
    prefetches_in_flight: int = _doc("prefetches whose blocks are being read", 0)
    prefetched_blocks: dict[str, int] = _doc("blocks prefetches brought up into host memory, by source tier", None)
    expired_protections: int = _doc("prefetch protections that ran out (their blocks became ordinary)", 0)
    dropped_blocks: dict[str, int] = _doc("blocks deletes dropped, per tier", None)
    skipped_in_use: int = _doc("device blocks deletes left to the running requests holding them", 0)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    num_waiting: int = _doc("sequences waiting for a slot", 0)
    num_running: int = _doc("sequences in the running batch", 0)
    num_requests: int = _doc("requests the engine holds", 0)
    num_blocks: int = _doc("device KV blocks in the pool", 0)
    num_free_blocks: int = _doc("device blocks not used by a request (may still hold a prefix)", 0)
    blocks_in_use: int = _doc("device blocks used by requests", 0)
    cached_blocks: int = _doc("device blocks holding a hashed prefix", 0)
    block_size: int = _doc("tokens per KV block", 0)
    block_bytes: int = _doc("bytes of one KV block (all layers, K and V)", 0)
    kv_pool_bytes: int = _doc("bytes of the device KV pool", 0)
    prefix_cache: PrefixCacheSnapshot = _doc("the prefix cache's counters", None)
    preemptions: int = _doc("sequences preempted", 0)
    preemptions_by_reason: dict[str, int] = _doc("preemptions by reason", None)
    tenant_usage: dict[str, Any] = _doc("per tenant: sequences and blocks held", None)
    requests_added: int = _doc("requests accepted", 0)
    requests_finished: int = _doc("requests finished", 0)
    requests_aborted: int = _doc("requests aborted", 0)
    prompt_tokens: int = _doc("prompt tokens of accepted requests", 0)
    cached_prompt_tokens: int = _doc("prompt tokens served from the cache (first choice of each request)", 0)
    computed_tokens: int = _doc("tokens whose KV the engine computed", 0)
    reused_tokens: int = _doc("tokens whose KV came from the cache (every choice)", 0)
    generated_tokens: int = _doc("tokens sampled", 0)
    steps: int = _doc("engine steps run", 0)
    step_time_s: float = _doc("time inside steps", 0.0)
    forward_time_s: float = _doc("time in forward passes", 0.0)
    sample_time_s: float = _doc("time sampling", 0.0)
    hash_time_s: float = _doc("time hashing prompt blocks", 0.0)
    num_loading: int = _doc("requests waiting for blocks from a lower tier", 0)
    promoted_blocks: int = _doc("blocks copied (or traded) up into the device pool", 0)
    prefill_tokens_per_s: float | None = _doc("running prefill rate (decides load vs recompute)", None)
    tiers: dict[str, Any] = _doc("`TierChain.snapshot()`: `chain` counters, then each attached tier", None)
    tier_kinds: list[str] = _doc("the kinds of tier `POST /admin/tiers` can attach", None)
    archetype: dict[str, Any] = _doc("the KV-cache archetype now (docs/archetype.md)", None)
    timing: dict[str, Any] = _doc("per-request engine timings: TTFT parts, TPOT (histograms)", None)
    gaps: dict[str, Any] = _doc("the survey's gap metrics (docs/metrics.md)", None)
    cache_control: CacheControlSnapshot = _doc("pins, prefetches and drops of the cache control API "
                                               "(docs/cache_api.md)", None)
    events: dict[str, Any] | None = _doc("KV events (docs/events.md): endpoint, batches sent, blocks announced "
                                         "by event and medium, resyncs; None when off", None)
    engine_pid: int = _doc("the engine process's pid", 0)
    engine_threads: dict[str, int | None] = _doc("thread ids: `owner` loaded the model, `step` runs steps", None)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values, as they cross the process boundary."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["prefix_cache"] = {f.name: getattr(self.prefix_cache, f.name) for f in fields(PrefixCacheSnapshot)}
        out["cache_control"] = {f.name: getattr(self.cache_control, f.name) for f in fields(CacheControlSnapshot)}
        return out


def take(core: EngineCore) -> EngineSnapshot:
    """The engine's state now (called on the step loop's thread)."""
    pool = core.manager.pool
    pc = core.manager.stats
    c = core.counters
    tiers = core.chain.snapshot() if core.chain is not None else {}
    return EngineSnapshot(
        num_waiting=len(core.scheduler.waiting), num_running=len(core.scheduler.running),
        num_requests=core.num_requests, num_blocks=pool.num_blocks, num_free_blocks=pool.num_free_blocks,
        blocks_in_use=core.manager.num_blocks_in_use, cached_blocks=pool.num_cached_blocks,
        block_size=core.block_size, block_bytes=core.storage.block_nbytes, kv_pool_bytes=core.storage.nbytes,
        prefix_cache=PrefixCacheSnapshot(
            lookups=pc.lookups, query_tokens=pc.query_tokens, hit_tokens=pc.hit_tokens,
            lookup_time_s=pc.lookup_time_s, evictions=pool.stats.evictions, block_hits=pool.stats.cache_hits,
            allocations=pool.stats.allocations, cached=pool.stats.cached, quota=pool.ledger.snapshot()),
        preemptions=core.scheduler.num_preemptions,
        preemptions_by_reason=dict(core.scheduler.preemptions_by_reason),
        tenant_usage=core.scheduler.tenant_stats(),
        requests_added=c.requests_added, requests_finished=c.requests_finished,
        requests_aborted=c.requests_aborted, prompt_tokens=c.prompt_tokens,
        cached_prompt_tokens=c.cached_prompt_tokens, computed_tokens=c.computed_tokens,
        reused_tokens=c.reused_tokens, generated_tokens=c.generated_tokens, steps=c.steps,
        step_time_s=c.step_time_s, forward_time_s=c.forward_time_s, sample_time_s=c.sample_time_s,
        hash_time_s=c.hash_time_s, num_loading=core.num_loading, promoted_blocks=pc.promoted_blocks,
        prefill_tokens_per_s=core.prefill_tokens_per_s, tiers=tiers, tier_kinds=list(factory.KINDS),
        archetype=archetype(core, tiers), timing=core.telemetry.snapshot(), gaps=gaps(core),
        cache_control=core.control.snapshot(),
        events=core.events.snapshot() if core.events is not None else None, engine_pid=os.getpid(), engine_threads={"owner": core.owner_thread, "step": core.step_thread})


def archetype(core: EngineCore, tiers: dict[str, Any]) -> dict[str, Any]:
    """The KV-cache archetype of the hierarchy as it runs now (see cache.archetype)."""
    sizes = {name: entry["capacity_blocks"] * core.storage.block_nbytes
             for name, entry in tiers.items() if name != "chain" and entry.get("capacity_blocks")}
    role = core.config.role
    view = describe(core.storage.device.type, core.config.enable_prefix_caching, tiers,
                    capacity_bytes={"device": core.storage.nbytes, **sizes}, disaggregated=role != "both",
                    role="" if role == "both" else role)
    return classify(view).to_dict()


def gaps(core: EngineCore) -> dict[str, Any]:
    """The survey's unmeasured quantities, live (docs/metrics.md says what each one means); the
    seventh, public traces, is recorded by the API process and added there."""
    chain = core.chain.telemetry() if core.chain is not None else {}
    tel = core.telemetry
    pc = core.manager.stats
    shared = core.chain.shared if core.chain is not None else None
    meta_bytes = sum(chain.get("metadata_bytes", {}).values())
    data_bytes = sum(chain.get("data_bytes", {}).values())
    return {
        "remote_access": chain.get("remote_access", {"attached": False}),
        "metadata": {
            "per_request_s": tel.metadata_s.snapshot(), "share_of_ttft": tel.metadata_share.snapshot(),
            "hash_time_s": core.counters.hash_time_s, "lookup_time_s": pc.lookup_time_s,
            "lookups": pc.lookups, "remote_exists_time_s": shared.exists_time_s if shared is not None else 0.0,
            "remote_exists_checks": shared.exists_checks if shared is not None else 0,
            "metadata_bytes": meta_bytes, "data_bytes": data_bytes,
            "bytes_ratio": meta_bytes / data_bytes if data_bytes else None,
            "by_tier": {name: {"metadata_bytes": n, "data_bytes": chain["data_bytes"][name]}
                        for name, n in chain.get("metadata_bytes", {}).items()}},
        "completion_overhead": chain.get("ops", {}),
        "block_life": {"device": core.manager.pool.life.snapshot(), **chain.get("life", {})},
        "prefetch_slack": {"slack_s": tel.slack_s.snapshot(), "tier_load_s": tel.tier_load_s.snapshot(),
                           "loads": tel.loads, "loads_within_slack": tel.loads_within_slack},
        "ttft_attribution": tel.attribution(),
    }


def schema_markdown() -> str:
    """The schema as Markdown tables (what docs/metrics.md holds under "The schema")."""
    out: list[str] = []
    for cls, title in ((EngineSnapshot, "`/admin/metrics` (engine part, top level)"),
                       (PrefixCacheSnapshot, "`prefix_cache`"),
                       (CacheControlSnapshot, "`cache_control` (docs/cache_api.md)"),
                       (TierSnapshot, "`tiers.<name>` (each attached tier)")):
        out += [f"#### {title}", "", "| field | type | meaning |", "|---|---|---|"]
        for f in fields(cls):
            kind = str(f.type).replace("|", "or")
            out.append(f"| `{f.name}` | `{kind}` | {f.metadata.get('doc', '')} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(schema_markdown())
