"""What the engine hands back to its callers: requests in, per-step deltas out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class GenerateRequest:
    """One generation request as the engine sees it: token ids, not text.

    `namespace_salt` is the tenant's secret (bytes) and `cache_salt` the optional per-request
    salt; both enter the hash of the first block, so differently salted requests never share KV.
    The full blocks of the first `public_prefix_len` tokens (a declared public prefix) hash under
    `public_salt` instead, shared by every tenant; the blocks after them are the tenant's again.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace_salt: bytes = b""
    cache_salt: str | None = None
    tenant: str = ""
    public_prefix_len: int = 0  # leading prompt tokens that are a declared public prefix
    public_salt: bytes = b""  # the public namespace's salt (hashes those tokens' full blocks)
    quota: Mapping[str, int] = field(default_factory=dict)  # tenant's block quota per tier (cache.quota)


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one sampled token and, if asked, of the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class SeqOutput:
    """One new token of one choice, and why the choice ended if it did: what a step emits, sent
    from the engine process to the API process (so it lives here, in a module without torch)."""

    request_id: str
    index: int
    token_id: int
    logprob: TokenLogprob | None
    finish_reason: str | None
    num_cached_tokens: int = 0
    cached_by_tier: dict[str, int] | None = None  # on a request's first token: its cached tokens per tier


@dataclass(slots=True)
class CompletionDelta:
    """New output of one choice (index < n) since the previous yield."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Per-request accounting; `cached_tokens` counts prompt tokens served from the KV cache."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # of cached_tokens, per tier that served them
    completion_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, seconds from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass(slots=True)
class RequestOutput:
    """One yield of `AsyncEngine.generate`: deltas for the choices that advanced."""

    request_id: str
    outputs: list[CompletionDelta]
    metrics: RequestMetrics
    finished: bool = False
