"""`/metrics`: the figures of `/admin/metrics` in the Prometheus text format, names `kvgate_*`.

Nothing on the hot path knows about Prometheus: the engine keeps plain counters and fixed-bucket
histograms, and each scrape turns one stats snapshot (one round trip to the engine process) into
metric families here. Names follow what users already grep for: vLLM's prefix-cache queries and
hits, SGLang's cached tokens, one `tier` label for the hierarchy. Label values are bounded: tiers,
op kinds, components, route templates, statuses and at most `MAX_TENANT_LABELS` tenants.
docs/metrics.md lists every name with its meaning.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

TIER_COUNTERS = {  # TierStats field → (metric suffix, help)
    "hits": ("hits", "Blocks found in the tier"),
    "misses": ("misses", "Blocks looked for and not found (or unusable) in the tier"),
    "puts": ("puts", "Blocks stored in the tier"),
    "evictions": ("evictions", "Blocks the tier evicted to make room"),
    "bytes_read": ("read_bytes", "Bytes read from the tier"),
    "bytes_written": ("written_bytes", "Bytes written to the tier"),
    "read_time_s": ("read_seconds", "Time spent in the tier's reads"),
    "write_time_s": ("write_seconds", "Time spent in the tier's writes"),
    "errors": ("errors", "Failed tier operations (they degrade to a miss)"),
    "corrupt": ("corrupt_blocks", "Blocks found damaged or foreign, deleted and counted as misses"),
    "undecodable": ("undecodable_blocks", "Records of a KV codec this server does not know, deleted and counted as misses"),
    "unauthentic": ("unauthentic_blocks", "Shared-store records whose MAC failed (planted, altered or written with "
                                          "another server secret), deleted and counted as misses"),
    "dropped": ("dropped_blocks", "Blocks not stored: back-pressure or a failed write"),
    "metadata_bytes": ("metadata_bytes", "Bytes describing blocks: keys, record headers, existence checks"),
    "handovers": ("handovers", "Blocks moved between the device pool and the tier by trading rows, no bytes copied "
                               "(a host tier sharing the pool's tensor on CPU)"),
}


def render(stats: dict[str, Any]) -> bytes:
    """The Prometheus text exposition of one `/admin/metrics` snapshot."""
    from prometheus_client import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats))
    return generate_latest(registry)


class _Snapshot(Collector):
    def __init__(self, stats: dict[str, Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield from _requests(s.get("requests", {}))
        yield _gauge("kvgate_ready", "1 when the model is loaded and the server takes requests", float(bool(s.get("ready"))))
        if "num_blocks" not in s:  # no engine yet: only the HTTP side
            return
        yield from _engine(s)
        yield from _tiers(s.get("tiers", {}))
        yield from _gaps(s.get("gaps", {}), s.get("timing", {}))
        yield from _cache_control(s.get("cache_control") or {})
        yield from _events(s.get("events") or {})
        archetype = s.get("archetype") or {}
        if archetype.get("name"):
            info = GaugeMetricFamily("kvgate_archetype_info", "The KV-cache archetype of the running hierarchy "
                                     "(always 1; the labels say which)", labels=["name", "locality", "lifetime",
                                                                                 "ownership", "substrate"])
            axes = archetype.get("axes", {})
            info.add_metric([archetype["name"], *(_axis(axes.get(k)) for k in ("locality", "lifetime", "ownership",
                                                                                  "substrate"))], 1.0)
            yield info


def _axis(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("value", value.get("name", ""))
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return "" if value is None else str(value)


# ---- helpers ------------------------------------------------------------------------------------
def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _labelled(kind: type, name: str, doc: str, label: str, values: Iterable[tuple[str, float]]) -> Metric:
    family = kind(name, doc, labels=[label])
    for key, value in values:
        family.add_metric([str(key)], float(value))
    return family


def _histogram(name: str, doc: str, labels: list[str] | None = None,
               series: Iterable[tuple[list[str], dict[str, Any]]] = ()) -> HistogramMetricFamily:
    """A histogram family from `Histogram.snapshot()` dicts (per-bucket counts → cumulative)."""
    family = HistogramMetricFamily(name, doc, labels=labels or [])
    for label_values, snap in series:
        if not snap or "buckets" not in snap:
            continue
        cumulative, buckets = 0, []
        for bound, count in zip(snap["buckets"], snap["counts"], strict=False):
            cumulative += count
            buckets.append((_le(bound), float(cumulative)))
        buckets.append(("+Inf", float(snap["count"])))
        family.add_metric(label_values, buckets, float(snap["sum"]))
    return family


def _le(bound: float) -> str:
    return repr(float(bound))


def _one(name: str, doc: str, snap: dict[str, Any] | None) -> HistogramMetricFamily:
    return _histogram(name, doc, None, [([], snap or {})])


# ---- families -----------------------------------------------------------------------------------
def _requests(r: dict[str, Any]) -> Iterator[Metric]:
    if not r:
        return
    yield _labelled(CounterMetricFamily, "kvgate_http_requests", "HTTP requests by route template", "route",
                    r.get("by_path", {}).items())
    yield _labelled(CounterMetricFamily, "kvgate_http_responses", "HTTP responses by status (499: client left)",
                    "status", r.get("by_status", {}).items())
    yield _gauge("kvgate_http_requests_in_flight", "HTTP requests being served", r.get("requests_in_flight", 0))
    yield _counter("kvgate_prompt_tokens", "Prompt tokens of generation requests", r.get("prompt_tokens_total", 0))
    yield _counter("kvgate_cached_tokens", "Prompt tokens served from the KV cache (usage.cached_tokens)",
                   r.get("cached_tokens_total", 0))
    yield _counter("kvgate_generation_tokens", "Completion tokens returned", r.get("completion_tokens_total", 0))
    yield _one("kvgate_request_ttft_seconds", "Time to first token, arrival to first token sent",
               r.get("ttft_s"))
    yield _one("kvgate_request_tpot_seconds", "Time per output token after the first", r.get("tpot_s"))
    yield _one("kvgate_request_e2e_seconds", "Arrival to the last byte of the response", r.get("e2e_s"))
    tenants = r.get("tenants", {})
    fields = (("requests", "Generation requests"), ("errors", "Generation requests that ended in an error"),
              ("prompt_tokens", "Prompt tokens"), ("cached_tokens", "Prompt tokens served from cache"),
              ("completion_tokens", "Completion tokens"))
    for field, doc in fields:
        yield _labelled(CounterMetricFamily, f"kvgate_tenant_{field}", f"{doc}, per tenant", "tenant",
                        ((name, t.get(field, 0)) for name, t in tenants.items()))
    yield _histogram("kvgate_tenant_ttft_seconds", "Time to first token per tenant", ["tenant"],
                     (([name], t.get("ttft_s", {})) for name, t in tenants.items()))


def _engine(s: dict[str, Any]) -> Iterator[Metric]:
    yield _gauge("kvgate_num_requests_running", "Sequences being stepped", s.get("num_running", 0))
    yield _gauge("kvgate_num_requests_waiting", "Sequences waiting for a slot", s.get("num_waiting", 0))
    yield _gauge("kvgate_num_requests_loading", "Requests waiting for their prefix to load from disk or remote",
                 s.get("num_loading", 0))
    yield _labelled(GaugeMetricFamily, "kvgate_kv_blocks", "Device KV blocks: in use by requests, or free "
                    "(free ones may still hold a reusable prefix)", "state",
                    (("in_use", s.get("blocks_in_use", 0)), ("free", s.get("num_free_blocks", 0))))
    yield _gauge("kvgate_kv_cached_blocks", "Device blocks holding a hashed prefix (in use or idle)",
                 s.get("cached_blocks", 0))
    yield _gauge("kvgate_kv_blocks_total", "Device KV blocks in the pool", s["num_blocks"])
    yield _gauge("kvgate_kv_pool_bytes", "Bytes of the device KV pool", s.get("kv_pool_bytes", 0))
    pc = s.get("prefix_cache", {})
    yield _counter("kvgate_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (as vLLM's "
                   "prefix_cache_queries)", pc.get("query_tokens", 0))
    yield _counter("kvgate_prefix_cache_hits", "Prompt tokens found in the prefix cache, any tier (as vLLM's "
                   "prefix_cache_hits)", pc.get("hit_tokens", 0))
    yield _counter("kvgate_prefix_cache_lookup_seconds", "Time spent in prefix-cache index lookups",
                   pc.get("lookup_time_s", 0.0))
    yield _labelled(CounterMetricFamily, "kvgate_preemptions", "Sequences preempted, by reason", "reason",
                    (s.get("preemptions_by_reason") or {}).items())
    yield _counter("kvgate_computed_tokens", "Tokens whose KV the engine computed", s.get("computed_tokens", 0))
    yield _counter("kvgate_reused_tokens", "Tokens whose KV came from the cache instead", s.get("reused_tokens", 0))
    yield _counter("kvgate_engine_steps", "Engine steps run", s.get("steps", 0))
    yield _counter("kvgate_engine_step_seconds", "Time inside engine steps", s.get("step_time_s", 0.0))


def _tiers(tiers: dict[str, Any]) -> Iterator[Metric]:
    names = [n for n, entry in tiers.items() if isinstance(entry, dict) and "traits" in entry]
    if not names:
        return
    for field, (suffix, doc) in TIER_COUNTERS.items():
        yield _labelled(CounterMetricFamily, f"kvgate_tier_{suffix}", doc, "tier",
                        ((n, tiers[n].get(field, 0)) for n in names))
    yield _labelled(GaugeMetricFamily, "kvgate_tier_blocks", "Blocks the tier holds (remote: unknown, 0)", "tier",
                    ((n, tiers[n].get("blocks", 0)) for n in names))
    yield _labelled(GaugeMetricFamily, "kvgate_tier_capacity_blocks", "Blocks the tier can hold (remote: 0, "
                    "bounded by Redis)", "tier", ((n, tiers[n].get("capacity_blocks", 0)) for n in names))
    yield _labelled(GaugeMetricFamily, "kvgate_tier_load_bytes_per_second", "The tier's running load-rate "
                    "estimate (decides load vs recompute)", "tier",
                    ((n, tiers[n].get("load_bytes_per_s", 0.0)) for n in names))
    yield _labelled(GaugeMetricFamily, "kvgate_tier_up", "1 when the tier serves (remote: circuit breaker not "
                    "open; disk: its folder usable and a reader thread free)", "tier",
                    ((n, float(tiers[n].get("breaker", "closed") != "open" and tiers[n].get("healthy", True) is not False))
                     for n in names))
    chain = tiers.get("chain", {})
    for field, doc in (("promotions", "Blocks copied up into the device pool from a lower tier"),
                       ("demotions", "Device blocks evicted into the lower tiers"),
                       ("prefetches", "Requests whose prefix was loaded from disk or remote before scheduling"),
                       ("prefetched_blocks", "Blocks loaded from disk or remote ahead of their request"),
                       ("recompute_chosen", "Lower-tier hits recomputed because loading was predicted slower"),
                       ("dropped_writes", "Writes dropped by back-pressure"),
                       ("flushed_blocks", "Blocks written to disk at shutdown or when host was detached"),
                       ("recalled_blocks", "Blocks asked for while their disk write was in flight, served from it"),
                       ("persisted_behind", "Blocks written to disk in the background (persist = behind or idle)")):
        yield _counter(f"kvgate_chain_{field}", doc, chain.get(field, 0))
    yield _gauge("kvgate_chain_unpersisted_blocks", "Blocks waiting for a background disk write (persist = behind or idle)",
                 chain.get("unpersisted_blocks", 0))


def _cache_control(c: dict[str, Any]) -> Iterator[Metric]:
    """Pins, prefetches and drops of the cache control API (docs/cache_api.md)."""
    if not c:
        return
    yield _labelled(GaugeMetricFamily, "kvgate_cache_pinned_blocks", "Blocks held by pins or prefetch protections, "
                    "per tier holding them now", "tier", (c.get("pinned_blocks") or {}).items())
    yield _gauge("kvgate_cache_pins", "Blocks pinned until unpinned", c.get("pinned_keys", 0))
    yield _gauge("kvgate_cache_protected_blocks", "Blocks protected by a prefetch until its TTL runs out",
                 c.get("protected_keys", 0))
    yield _labelled(CounterMetricFamily, "kvgate_cache_control_requests", "Cache control requests by operation "
                    "(lookup, prefetch, pin, unpin, delete)", "op", (c.get("requests") or {}).items())
    yield _labelled(CounterMetricFamily, "kvgate_cache_prefetched_blocks", "Blocks cache prefetches brought up "
                    "into host memory, by the tier they came from", "tier", (c.get("prefetched_blocks") or {}).items())
    yield _counter("kvgate_cache_expired_protections", "Prefetch protections that ran out (their blocks became "
                   "ordinary)", c.get("expired_protections", 0))
    yield _labelled(CounterMetricFamily, "kvgate_cache_dropped_blocks", "Blocks cache deletes dropped, per tier",
                    "tier", (c.get("dropped_blocks") or {}).items())
    yield _counter("kvgate_cache_delete_skipped_blocks", "Device blocks a cache delete left to the running "
                   "requests holding them", c.get("skipped_in_use", 0))


def _events(e: dict[str, Any]) -> Iterator[Metric]:
    """KV events (docs/events.md), when they are on."""
    if not e:
        return
    blocks = CounterMetricFamily("kvgate_kv_event_blocks", "Blocks announced in KV events, by event and medium "
                                 "(GPU: the engine's pool, CPU: host, DISK, REMOTE)", labels=["event", "medium"])
    for event, by_medium in sorted((e.get("blocks") or {}).items()):
        for medium, n in sorted(by_medium.items()):
            blocks.add_metric([event, medium], float(n))
    yield blocks
    yield _counter("kvgate_kv_event_batches", "KV event batches published", e.get("batches", 0))
    yield _counter("kvgate_kv_event_resyncs", "Times the event queue overflowed and published AllBlocksCleared "
                   "instead of what waited", e.get("resyncs", 0))
    yield _gauge("kvgate_kv_event_queued", "Events waiting for the publisher", e.get("queued", 0))


def _gaps(g: dict[str, Any], timing: dict[str, Any]) -> Iterator[Metric]:
    # 1. remote access patterns
    access = g.get("remote_access", {})
    if access.get("ops"):
        yield _histogram("kvgate_remote_batch_blocks", "Blocks per pipelined remote operation", ["op"],
                         (([op], h) for op, h in access.get("batch_blocks", {}).items()))
        yield _histogram("kvgate_remote_op_bytes", "Bytes per pipelined remote operation", ["op"],
                         (([op], h) for op, h in access.get("op_bytes", {}).items()))
        if access.get("read_share") is not None:
            yield _gauge("kvgate_remote_read_share", "Share of remote blocks moved that were reads",
                         access["read_share"])
    # 2. metadata-path cost
    meta = g.get("metadata", {})
    if meta:
        yield _one("kvgate_metadata_seconds", "Per request: hashing, index lookups, remote existence checks",
                   meta.get("per_request_s"))
        yield _one("kvgate_metadata_ttft_share", "Per request: metadata time as a share of engine TTFT",
                   meta.get("share_of_ttft"))
        yield _counter("kvgate_metadata_hash_seconds", "Time hashing prompt blocks", meta.get("hash_time_s", 0.0))
        yield _counter("kvgate_remote_exists_seconds", "Time in remote existence checks",
                       meta.get("remote_exists_time_s", 0.0))
        if meta.get("bytes_ratio") is not None:
            yield _gauge("kvgate_metadata_data_bytes_ratio", "Bytes describing blocks per byte of block moved "
                         "below the device", meta["bytes_ratio"])
    # 3. operation-completion overhead
    ops = g.get("completion_overhead", {})
    yield _histogram("kvgate_tier_op_issue_to_done_seconds", "From the step loop asking to it learning an op "
                     "finished", ["op"], (([op], o.get("issue_to_done_s", {})) for op, o in ops.items()))
    yield _histogram("kvgate_tier_op_transfer_seconds", "Time inside the tier call itself", ["op"],
                     (([op], o.get("transfer_s", {})) for op, o in ops.items()))
    # 4. reuse distance and lifetime
    life = g.get("block_life", {})
    yield _histogram("kvgate_block_reuse_distance", "Tier accesses between two uses of a block", ["tier"],
                     (([t], v.get("reuse_distance", {})) for t, v in life.items()))
    yield _histogram("kvgate_block_reuse_interval_seconds", "Time between two uses of a block", ["tier"],
                     (([t], v.get("reuse_interval_s", {})) for t, v in life.items()))
    yield _histogram("kvgate_block_lifetime_seconds", "From a block entering a tier to leaving it", ["tier"],
                     (([t], v.get("lifetime_s", {})) for t, v in life.items()))
    # 5. prefetchability slack
    slack = g.get("prefetch_slack", {})
    if slack:
        yield _one("kvgate_prefetch_slack_seconds", "Arrival to the first step that needs the request's blocks, "
                   "less its own load wait", slack.get("slack_s"))
        yield _one("kvgate_tier_load_seconds", "Per request that loaded from a lower tier: time held for it",
                   slack.get("tier_load_s"))
        yield _counter("kvgate_tier_loads", "Requests that loaded blocks from a lower tier", slack.get("loads", 0))
        yield _counter("kvgate_tier_loads_within_slack", "Of those, the ones whose load fit in their slack",
                       slack.get("loads_within_slack", 0))
    # 6. P99 TTFT attribution
    att = g.get("ttft_attribution", {})
    if att.get("components_s"):
        yield _labelled(GaugeMetricFamily, "kvgate_ttft_p99_attribution_seconds", "Mean of each part over the "
                        "recent requests at or above the P99 engine TTFT", "component", att["components_s"].items())
    yield _one("kvgate_engine_ttft_seconds", "Engine side TTFT: the engine taking the request to its first token",
               timing.get("ttft_s"))
    yield _one("kvgate_engine_queue_seconds", "Time waiting for a slot before the first token", timing.get("queue_s"))
    yield _one("kvgate_engine_prefill_seconds", "Forward passes computing a request's prompt", timing.get("prefill_s"))
    # 7. public traces
    traces = g.get("traces", {})
    if "recorded" in traces:
        yield _gauge("kvgate_trace_records", "Requests in the trace ring (GET /admin/trace)", traces["recorded"])
