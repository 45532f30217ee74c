"""Request validation from fixed limits alone, so any process can check a request.

The API process validates before it sends anything to the engine process; the engine checks
again (a request must never make the step loop raise). Both hold the same `RequestLimits`,
which the engine reports once its model is loaded.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Vocabulary, context and KV-pool limits every request is checked against."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int

    def validate(self, request: GenerateRequest) -> None:
        """Raise a typed error for bad input before anything is allocated."""
        params = request.params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be SamplingParams", param="params")
        if request.cache_salt is not None:
            try:
                request.cache_salt.encode("utf-8")
            except (AttributeError, UnicodeEncodeError):
                raise InvalidRequestError("cache_salt must be a valid Unicode string", param="cache_salt") from None
        ids = request.prompt_token_ids
        if not ids:
            raise InvalidRequestError("prompt is empty: send at least one token", param="prompt")
        vocab = self.vocab_size
        try:  # C loops: a 128-prompt request holds ~10^5 ids, checked on the API's event loop
            packed = array("q", ids)
            ok = min(packed) >= 0 and max(packed) < vocab
        except (TypeError, OverflowError):
            ok = False
        if not ok:
            bad = next(t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab)
            raise InvalidRequestError(
                f"prompt token id {bad!r} is out of range: ids must be integers in [0, {vocab})",
                param="prompt")
        public = request.public_prefix_len
        if isinstance(public, bool) or not isinstance(public, int) or not 0 <= public <= len(ids):
            raise InvalidRequestError(f"public_prefix_len {public!r} must be in [0, {len(ids)}] (the prompt's "
                                      "length)", param="public_prefix_len")
        for t in params.stop_token_ids:
            if t >= vocab:
                raise InvalidRequestError(
                    f"stop_token_ids entry {t} is out of range [0, {vocab})", param="stop_token_ids")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(ids)} in the prompt, {params.max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.", param="max_tokens" if len(ids) < self.max_model_len
                else "prompt")
        needed = self.worst_case_blocks(len(ids), params.max_tokens, 1)
        if needed > self.num_blocks:
            raise InvalidRequestError(
                f"request needs {needed} KV blocks of {self.block_size} tokens but the pool has "
                f"{self.num_blocks}; reduce max_tokens or raise cache.device.num_blocks",
                param="max_tokens")

    def worst_case_blocks(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """KV blocks a request holds at its longest: the prompt's full blocks once (its `n`
        sequences share them), each sequence's partial prompt block and output blocks on its own."""
        shared = prompt_len // self.block_size
        own = -(-(prompt_len + max_tokens) // self.block_size) - shared
        return shared + n * own

    def validate_job(self, requests: list[GenerateRequest]) -> None:
        """The requests of one HTTP call together: all their sequences must fit the KV pool at once,
        or the call could never run as one and is refused up front (a 429 could not be outwaited)."""
        needed = sum(self.worst_case_blocks(len(r.prompt_token_ids), r.params.max_tokens, r.params.n)
                     for r in requests)
        if needed > self.num_blocks:
            raise InvalidRequestError(
                f"this request needs up to {needed} KV blocks of {self.block_size} tokens for its "
                f"{sum(r.params.n for r in requests)} sequence(s), but the pool has {self.num_blocks}; "
                "reduce n, max_tokens or the number of prompts (or raise cache.device.num_blocks)",
                param="max_tokens", code="request_too_large")
