"""Per-request sampling settings, validated once when the request enters the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
_MAX_N = 16
_MAX_STOP = 16
_MAX_LOGPROBS = 20
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _check_int(value: object, param: str, low: int, high: int | None = None) -> int:
    """Return `value` if it is an int (not a bool) in [low, high], else raise."""
    bound = f">= {low}" if high is None else f"between {low} and {high}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{param} must be an integer {bound}, got {value!r}", param=param)
    if value < low or (high is not None and value > high):
        raise InvalidRequestError(f"{param} must be {bound}, got {value}", param=param)
    return value


def _check_float(
    value: object, param: str, low: float, high: float, low_open: bool = False
) -> float:
    """Return `value` as a float if it is a finite number in [low, high] ((low, high] if `low_open`)."""
    bound = f"{'>' if low_open else '>='} {low} and <= {high}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{param} must be a number {bound}, got {value!r}", param=param)
    number = float(value)
    if not math.isfinite(number):
        raise InvalidRequestError(f"{param} must be a finite number {bound}, got {value}", param=param)
    if number < low or (low_open and number == low) or number > high:
        raise InvalidRequestError(f"{param} must be {bound}, got {value}", param=param)
    return number


@dataclass(slots=True)
class SamplingParams:
    """How to pick each output token of a request, and when to stop; OpenAI names and ranges.

    `top_k` of 0 or -1 disables it (stored as 0); `logprobs` is None for no logprobs, or the number
    (0..20) of top alternatives returned next to the chosen token's own logprob.
    """

    max_tokens: int = 16
    min_tokens: int = 0  # vLLM's extension: EOS and stop_token_ids cannot end a choice before this many
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.max_tokens = _check_int(self.max_tokens, "max_tokens", 1)
        self.min_tokens = _check_int(self.min_tokens, "min_tokens", 0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                      f"({self.max_tokens})", param="min_tokens")
        self.temperature = _check_float(self.temperature, "temperature", 0.0, 2.0)
        self.top_p = _check_float(self.top_p, "top_p", 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (disabled) or an integer >= 1, got {self.top_k!r}",
                param="top_k",
            )
        self.top_k = max(self.top_k, 0)
        self.min_p = _check_float(self.min_p, "min_p", 0.0, 1.0)
        if self.seed is not None:
            self.seed = _check_int(self.seed, "seed", _SEED_MIN, _SEED_MAX)
        self.n = _check_int(self.n, "n", 1, _MAX_N)
        self._check_stop()
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}",
                                      param="ignore_eos")
        self.presence_penalty = _check_float(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        self.frequency_penalty = _check_float(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        self.repetition_penalty = _check_float(
            self.repetition_penalty, "repetition_penalty", 0.0, 2.0, low_open=True
        )
        if self.logprobs is not None:
            self.logprobs = _check_int(self.logprobs, "top_logprobs", 0, _MAX_LOGPROBS)

    def _check_stop(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or len(self.stop) > _MAX_STOP:
            raise InvalidRequestError(
                f"stop must be a string or a list of at most {_MAX_STOP} strings, got {self.stop!r}",
                param="stop",
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop entries must be non-empty strings, got {s!r}",
                                          param="stop")
        if not isinstance(self.stop_token_ids, list):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                param="stop_token_ids",
            )
        for t in self.stop_token_ids:
            _check_int(t, "stop_token_ids", 0)

    @property
    def greedy(self) -> bool:
        """True when the temperature is (near) zero: the argmax token is always chosen."""
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition, presence or frequency penalties changes the logits."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
