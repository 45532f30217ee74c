"""`/v1/models`, `/v1/completions`, `/v1/chat/completions`: HTTP requests → engine requests.

Each handler checks the model and the unsupported fields, turns the prompt into token ids (chat
messages through the model's chat template), submits one engine request per prompt with the
tenant's namespace salt, then either streams SSE chunks or collects the whole response. A client
that disconnects, streaming or not, aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response

from app.auth import CurrentTenant, Engine
from app.errors import ModelNotFoundError
from app.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from app.streaming import Job, chat_stream, completion_stream
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from tenants.registry import Tenant

router = APIRouter(prefix="/v1", tags=["openai"])

_CHAT_ROLES = ("system", "user", "assistant", "developer")
_THREAD_TOKENIZE_CHARS = 4096  # longer texts are tokenized off the event loop
_T = TypeVar("_T")


@router.get("/models", response_model=ModelList)
async def list_models(request: Request, tenant: CurrentTenant, engine: Engine) -> ModelList:
    return ModelList(data=[_model_card(request, engine)])


@router.get("/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, request: Request, tenant: CurrentTenant, engine: Engine) -> ModelCard:
    _check_model(model_id, engine)
    return _model_card(request, engine)


@router.post("/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request, tenant: CurrentTenant,
                            engine: Engine) -> Response | CompletionResponse:
    _check_model(body.model, engine)
    body.check_supported()
    prompts = await _completion_prompts(engine, body.prompt)
    params = [body.sampling_params(_remaining(engine, p)) for p in prompts]
    job = _submit(request, engine, f"cmpl-{uuid.uuid4().hex}", prompts, params, tenant, body.cache_salt,
                  prompt_param="prompt")
    if body.stream:
        return completion_stream(job, body.include_usage)
    result = await _until_disconnect(request, _collect(job))
    if result is None:
        return Response(status_code=499)
    texts, finish, logprobs = result
    choices = [CompletionChoice(index=i, text="".join(texts[i]), finish_reason=finish[i],
                                logprobs=job.completion_logprobs(i, logprobs[i]))
               for i in range(job.num_choices)]
    return CompletionResponse(id=job.id, created=job.created, model=job.model,
                              system_fingerprint=job.fingerprint, choices=choices, usage=job.usage())


@router.post("/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, tenant: CurrentTenant,
                                 engine: Engine) -> Response | ChatCompletionResponse:
    _check_model(body.model, engine)
    body.check_supported()
    prompt = await _chat_prompt(engine, body.messages)
    params = body.sampling_params(_remaining(engine, prompt))
    job = _submit(request, engine, f"chatcmpl-{uuid.uuid4().hex}", [prompt], [params], tenant,
                  body.cache_salt, prompt_param="messages")
    if body.stream:
        return chat_stream(job, body.include_usage)
    result = await _until_disconnect(request, _collect(job))
    if result is None:
        return Response(status_code=499)
    texts, finish, logprobs = result
    choices = [ChatChoice(index=i, message=ChatMessageOut(content="".join(texts[i])),
                          finish_reason=finish[i],
                          logprobs=job.chat_logprobs(logprobs[i]) if body.logprobs else None)
               for i in range(job.num_choices)]
    return ChatCompletionResponse(id=job.id, created=job.created, model=job.model,
                                  system_fingerprint=job.fingerprint, choices=choices, usage=job.usage())


# ------------------------------------------------------------------ helpers


def _model_card(request: Request, engine: AsyncEngine) -> ModelCard:
    return ModelCard(id=engine.model_name, created=request.app.state.started_at,
                     max_model_len=engine.max_model_len)


def _check_model(model: str, engine: AsyncEngine) -> None:
    if model != engine.model_name:
        raise ModelNotFoundError(model)


def _remaining(engine: AsyncEngine, prompt: list[int]) -> int:
    """Default output budget: the rest of the context (at least 1, so the engine names the limit)."""
    return max(1, engine.max_model_len - len(prompt))


async def _tokenize(engine: AsyncEngine, text: str, add_special_tokens: bool = True) -> list[int]:
    def encode() -> list[int]:
        return list(engine.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    return await asyncio.to_thread(encode) if len(text) > _THREAD_TOKENIZE_CHARS else encode()


def _non_empty(ids: list[int], param: str) -> list[int]:
    """Token ids as a list; empty prompts are refused here so the error names which one."""
    if not ids:
        raise InvalidRequestError("The prompt must not be empty.", param=param)
    return ids


async def _completion_prompts(engine: AsyncEngine, prompt: Any) -> list[list[int]]:
    """String, list of strings, token ids or list of token-id lists → one id list per prompt."""
    if isinstance(prompt, str):
        return [_non_empty(await _tokenize(engine, prompt), "prompt")]
    if not prompt:
        raise InvalidRequestError("The prompt must not be empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [_non_empty(await _tokenize(engine, p), f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_non_empty(list(p), f"prompt[{i}]") for i, p in enumerate(prompt)]


async def _chat_prompt(engine: AsyncEngine, messages: list[ChatMessage]) -> list[int]:
    """Messages → the chat template's text (with the assistant turn opened) → token ids."""
    tokenizer = engine.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError("This model has no chat template; use /v1/completions.",
                                  param="messages")
    has_developer = "developer" in str(template)
    conversation = []
    for i, message in enumerate(messages):
        if message.role not in _CHAT_ROLES:
            raise InvalidRequestError(f"Unsupported role {message.role!r}; use one of {', '.join(_CHAT_ROLES)}.",
                                      param=f"messages[{i}].role")
        role = "system" if message.role == "developer" and not has_developer else message.role
        conversation.append({"role": role, "content": _message_text(message, i)})
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2 TemplateError, ValueError: the messages do not fit the template
        raise InvalidRequestError(f"The messages do not fit the model's chat template: {exc}",
                                  param="messages") from exc
    return await _tokenize(engine, text, add_special_tokens=False)


def _message_text(message: ChatMessage, i: int) -> str:
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise InvalidRequestError("Message content must not be null.", param=f"messages[{i}].content")
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise InvalidRequestError(f"Content part type {part.type!r} is not supported; only 'text' is.",
                                      param=f"messages[{i}].content[{j}].type")
        if part.text is None:
            raise InvalidRequestError("A text content part needs 'text'.",
                                      param=f"messages[{i}].content[{j}].text")
        texts.append(part.text)
    return "\n".join(texts)


def _submit(request: Request, engine: AsyncEngine, job_id: str, prompts: list[list[int]],
            params: list[SamplingParams], tenant: Tenant, cache_salt: str | None, prompt_param: str) -> Job:
    """Add one engine request per prompt; if any is refused, abort those already added."""
    request_ids = [job_id] if len(prompts) == 1 else [f"{job_id}-{i}" for i in range(len(prompts))]
    streams = []
    try:
        for request_id, prompt, sampling in zip(request_ids, prompts, params, strict=True):
            streams.append(engine.add_request(GenerateRequest(
                request_id=request_id, prompt_token_ids=prompt, params=sampling,
                namespace_salt=tenant.salt, cache_salt=cache_salt, tenant=tenant.name)))
    except BaseException as exc:
        for request_id in request_ids[:len(streams)]:
            engine.abort(request_id)
        if isinstance(exc, InvalidRequestError) and exc.param == "prompt":
            exc.param = prompt_param
        raise
    return Job(id=job_id, model=engine.model_name, fingerprint=request.app.state.fingerprint,
               engine=engine, tokenizer=engine.tokenizer, request_ids=request_ids, streams=streams,
               n=params[0].n, state=request.state)


async def _collect(job: Job) -> tuple[list[list[str]], list[Any], list[Any]]:
    """Run a job to the end: text pieces, finish reason and logprobs per choice."""
    texts: list[list[str]] = [[] for _ in range(job.num_choices)]
    finish: list[Any] = [None] * job.num_choices
    logprobs: list[Any] = [None] * job.num_choices
    async for index, out in job.outputs():
        for delta in out.outputs:
            choice = index * job.n + delta.index
            texts[choice].append(delta.text)
            if delta.finish_reason is not None:
                finish[choice] = delta.finish_reason
            if delta.logprobs is not None:
                if logprobs[choice] is None:
                    logprobs[choice] = []
                logprobs[choice].extend(delta.logprobs)
    return texts, finish, logprobs


async def _until_disconnect(request: Request, work: Awaitable[_T]) -> _T | None:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        request.state.disconnected = True
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()
