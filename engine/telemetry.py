"""Where a request's time to first token goes, measured inside the engine (gap metrics 2, 5, 6).

Each request's first choice carries a `RequestTiming` from the moment the engine takes it until
its first token: hashing and index lookups (metadata), waiting for lower-tier loads and copying
promoted blocks in (tier load), the forward passes that computed its prompt (prefill), the
sampling of the step that produced the token (first decode); the rest is queueing. Only the step
loop writes here: additions, no locks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from cache.telemetry import RATIOS, SECONDS, Histogram

__all__ = ["COMPONENTS", "SECONDS", "EngineTelemetry", "Histogram", "RequestTiming"]

COMPONENTS = ("queue", "metadata", "tier_load", "prefill", "first_decode")


@dataclass(slots=True)
class RequestTiming:
    added: float  # perf_counter when the engine took the request
    metadata_s: float = 0.0  # prompt hashing, index lookups, remote existence checks
    load_s: float = 0.0  # held back while lower tiers load + promoted blocks copied in
    load_started: float | None = None
    prefill_s: float = 0.0  # forward passes that computed part of its prompt
    first_scheduled: float | None = None
    lower_tier: bool = False  # some of its prefix came from host, disk or remote


class EngineTelemetry:
    """Histograms of the TTFT parts and a ring of recent breakdowns for the P99 attribution."""

    def __init__(self, samples: int = 4096) -> None:
        self.ttft_s = Histogram(SECONDS)  # engine side: from add_request to the first token
        self.queue_s = Histogram(SECONDS)
        self.metadata_s = Histogram(SECONDS)
        self.metadata_share = Histogram(RATIOS)  # metadata / TTFT per request
        self.tier_load_s = Histogram(SECONDS)  # requests that loaded something only
        self.prefill_s = Histogram(SECONDS)
        self.slack_s = Histogram(SECONDS)  # arrival → first step, less its own load wait
        self.loads = 0
        self.loads_within_slack = 0
        self._recent: deque[tuple[float, ...]] = deque(maxlen=samples)

    def first_token(self, t: RequestTiming, now: float, first_decode_s: float) -> None:
        ttft = now - t.added
        parts = (t.metadata_s, t.load_s, t.prefill_s, first_decode_s)
        queue = max(0.0, ttft - sum(parts))
        self.ttft_s.observe(ttft)
        self.queue_s.observe(queue)
        self.metadata_s.observe(t.metadata_s)
        self.metadata_share.observe(t.metadata_s / ttft if ttft > 0 else 0.0)
        self.prefill_s.observe(t.prefill_s)
        first_step = t.first_scheduled if t.first_scheduled is not None else now
        slack = max(0.0, first_step - t.added - t.load_s)
        self.slack_s.observe(slack)
        if t.lower_tier:
            self.tier_load_s.observe(t.load_s)
            self.loads += 1
            self.loads_within_slack += t.load_s <= slack
        self._recent.append((ttft, queue, *parts))

    def attribution(self, q: float = 0.99) -> dict[str, Any]:
        """Mean of each part over the recent requests whose TTFT is at or above its q-quantile."""
        samples = sorted(self._recent)
        if not samples:
            return {"samples": 0, "quantile": q, "ttft_s": None, "components_s": None, "shares": None}
        cut = samples[min(len(samples) - 1, int(q * len(samples)))][0]
        tail = [s for s in samples if s[0] >= cut]
        means = [sum(s[i] for s in tail) / len(tail) for i in range(len(COMPONENTS) + 1)]
        total = means[0] or 1.0
        return {"samples": len(samples), "quantile": q, "ttft_s": cut, "tail_requests": len(tail),
                "components_s": dict(zip(COMPONENTS, means[1:], strict=True)),
                "shares": {k: v / total for k, v in zip(COMPONENTS, means[1:], strict=True)}}

    def snapshot(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s.snapshot(), "queue_s": self.queue_s.snapshot(),
                "metadata_s": self.metadata_s.snapshot(), "metadata_share": self.metadata_share.snapshot(),
                "tier_load_s": self.tier_load_s.snapshot(), "prefill_s": self.prefill_s.snapshot(),
                "slack_s": self.slack_s.snapshot(), "loads": self.loads,
                "loads_within_slack": self.loads_within_slack}
