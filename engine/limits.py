"""Request validation from fixed limits alone, so any process can check a request.

The API process validates before it sends anything to the engine process; the engine checks
again (a request must never make the step loop raise). Both hold the same `RequestLimits`,
which the engine reports once its model is loaded.
"""

from __future__ import annotations

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
        ids = request.prompt_token_ids
        if not ids:
            raise InvalidRequestError("prompt is empty: send at least one token", param="prompt")
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt token id {t!r} is out of range: ids must be integers in [0, {vocab})",
                    param="prompt")
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
        needed = -(-total // self.block_size)
        if needed > self.num_blocks:
            raise InvalidRequestError(
                f"request needs {needed} KV blocks of {self.block_size} tokens but the pool has "
                f"{self.num_blocks}; reduce max_tokens or raise cache.device.num_blocks",
                param="max_tokens")
