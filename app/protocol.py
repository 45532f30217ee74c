"""OpenAI protocol models: requests in, responses and stream chunks out, and the error body.

Requests are as strict as OpenAI's API: types are not coerced (`"max_tokens": "5"` and
`"stream": "yes"` are 400s, as `true` for an integer is), every string must be valid Unicode
(a lone UTF-16 surrogate such as `"\\ud800"` is a 400 naming the field), and a top-level field
OpenAI's API does not define is refused ("Unrecognized request argument"), not silently ignored.
Fields OpenAI defines that do not change the output here (`user`, `metadata`, `store`, ...) are
accepted and ignored; fields that would change it and that KVGate does not implement (`echo`,
`suffix`, `logit_bias`, tools, functions, audio, ...) are refused with a 400 naming them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer
from pydantic_core import PydanticCustomError

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length"]

MAX_MESSAGES = 4096  # chat messages per request (checked before any message is parsed)
MAX_PROMPTS = 4096  # prompts in one completion request's list (server.max_fanout is usually lower)


def _bad_string(value: Any, where: str = "") -> str | None:
    """Where in `value` (a JSON value) a string that is not valid Unicode sits, or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "the value"
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _bad_string(item, f"{where}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _bad_string(key, f"{where} key {key!r}") or _bad_string(item, f"{where}.{key}")
            if found is not None:
                return found
    return None


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        found = _bad_string(value)
        if found is not None:
            raise PydanticCustomError(
                "invalid_unicode", "the string at {where} is not valid Unicode (it holds a lone UTF-16 "
                "surrogate); send text encoded as UTF-8", {"where": found})
        return value


class StreamOptions(RequestModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False


class _GenerationRequest(RequestModel):
    """Fields shared by completions and chat completions (OpenAI names, plus vLLM's extras)."""

    model: str
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    cache_salt: str | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    # accepted only in their neutral form
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Reject fields whose non-default values KVGate cannot honour."""
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (use n)", param="best_of")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("only response_format {\"type\": \"text\"} is supported",
                                      param="response_format")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true",
                                      param="stream_options")
        if self.stream is None:
            self.stream = False
        if self.n is None:
            self.n = 1
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        fields: dict[str, Any] = {
            "max_tokens": max_tokens, "n": self.n, "logprobs": logprobs,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
        }
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and prompt and not isinstance(prompt[0], int):
            raise PydanticCustomError("too_long", "at most {limit} prompts per request, got {count}",
                                      {"limit": MAX_PROMPTS, "count": len(prompt)})
        return prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        try:
            return self._sampling_params(max_tokens, self.logprobs)
        except InvalidRequestError as exc:
            if exc.param == "top_logprobs":
                exc.param = "logprobs"
            raise


class ContentPart(RequestModel):
    """One part of a message's content; only `text` parts are served (the others are refused)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    """A chat message with OpenAI's fields, so an SDK response message can be sent back as is."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[Any] | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    # OpenAI fields that do not change the output here: accepted and ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields that would change the output: refused unless absent or neutral
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, messages: Any) -> Any:
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
            raise PydanticCustomError("too_long", "at most {limit} messages per request, got {count}",
                                      {"limit": MAX_MESSAGES, "count": len(messages)})
        return messages

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools is not None:
            raise InvalidRequestError("tools are not supported by this server", param="tools")
        if self.tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is not supported", param="tool_choice")
        if self.functions is not None:
            raise InvalidRequestError("functions are not supported by this server", param="functions")
        if self.function_call not in (None, "none"):
            raise InvalidRequestError("function_call is not supported", param="function_call")
        for name in ("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"{name} is not supported by this model", param=name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise InvalidRequestError('only modalities ["text"] is supported', param="modalities")
        for i, message in enumerate(self.messages):
            for name in ("tool_calls", "function_call", "audio"):
                if getattr(message, name):
                    raise InvalidRequestError(f"messages with {name} are not supported",
                                              param=f"messages[{i}].{name}")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None),
                          default_max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs)
        except InvalidRequestError as exc:
            if exc.param == "max_tokens" and self.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    cached_tokens_per_tier: dict[str, int] = Field(
        default_factory=dict, description="KVGate: of cached_tokens, how many each tier served (device, host, "
                                          "disk, remote, ...; tiers that served none left out)")


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvgate"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The one error body of every endpoint: `{"error": {message, type, param, code}}`."""

    error: ErrorDetail
