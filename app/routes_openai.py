"""`/v1/models`, `/v1/completions`, `/v1/chat/completions`: HTTP requests → engine requests.

Each handler checks the model, the unsupported fields and the request's fan-out, turns the prompt
into token ids off the event loop (`app.prompts`; chat messages through the model's chat
template), submits one engine request per prompt with the tenant's namespace salt (all or none),
then either streams SSE chunks or collects the whole response. A client
that disconnects, streaming or not, aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response

from app.auth import CurrentTenant, Engine
from app.disagg import await_shipped
from app.errors import ModelNotFoundError, RateLimitError
from app.prompts import builder_of, check_fanout
from app.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from app.streaming import Job, chat_stream, completion_stream
from app.trace import trace_recorder
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from tenants.limits import Refusal
from tenants.public import PublicPrefixes
from tenants.registry import Tenant

router = APIRouter(prefix="/v1", tags=["openai"])

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
    num_prompts = len(body.prompt) if isinstance(body.prompt, list) and body.prompt \
        and not isinstance(body.prompt[0], int) else 1
    check_fanout(num_prompts, body.n or 1, request.app.state.settings.server.max_fanout, engine.max_sequences)
    builder = builder_of(request.app.state, engine)
    prompts = await builder.completion(body.prompt)
    params = [body.sampling_params(_remaining(engine, p)) for p in prompts]
    public = await request.app.state.public_prefixes.ready(builder)
    job = _submit(request, engine, f"cmpl-{uuid.uuid4().hex}", prompts, params, tenant, body.cache_salt,
                  prompt_param="prompt", public=public)
    if body.stream:
        return completion_stream(job, body.include_usage)
    result = await _collected(request, job)
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
    check_fanout(1, body.n or 1, request.app.state.settings.server.max_fanout, engine.max_sequences)
    builder = builder_of(request.app.state, engine)
    prompt = await builder.chat(body.messages)
    params = body.sampling_params(_remaining(engine, prompt))
    public = await request.app.state.public_prefixes.ready(builder)
    job = _submit(request, engine, f"chatcmpl-{uuid.uuid4().hex}", [prompt], [params], tenant,
                  body.cache_salt, prompt_param="messages", public=public)
    if body.stream:
        return chat_stream(job, body.include_usage)
    result = await _collected(request, job)
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


def _submit(request: Request, engine: AsyncEngine, job_id: str, prompts: list[list[int]],
            params: list[SamplingParams], tenant: Tenant, cache_salt: str | None, prompt_param: str,
            public: PublicPrefixes) -> Job:
    """Add one engine request per prompt; if any is refused, abort those already added.

    A prompt's leading tokens that agree with a declared public prefix hash in the public
    namespace (unless the caller asked for isolation with `cache_salt`).

    When the job's outputs end, each prompt the engine ran goes into the request trace (`app.trace`).
    """
    request_ids = [job_id] if len(prompts) == 1 else [f"{job_id}-{i}" for i in range(len(prompts))]
    state = request.app.state
    registry = state.registry
    public_lens = [public.match(prompt) if cache_salt is None and len(public) else 0 for prompt in prompts]
    tokens = sum(len(p) + (s.max_tokens or 0) * s.n for p, s in zip(prompts, params, strict=True))
    slot = request.app.state.limiter.acquire(tenant.name, tenant.limits, tokens)
    if isinstance(slot, Refusal):
        raise RateLimitError(slot.message, slot.retry_after_s)
    try:
        streams = engine.add_requests([
            GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=sampling,
                            namespace_salt=tenant.salt, cache_salt=cache_salt, tenant=tenant.name,
                            public_prefix_len=public_len, public_salt=registry.public_salt, quota=tenant.quota)
            for request_id, prompt, sampling, public_len in zip(request_ids, prompts, params, public_lens,
                                                                strict=True)])
    except InvalidRequestError as exc:
        slot.release()
        if exc.param == "prompt":
            exc.param = prompt_param
        raise
    except BaseException:
        slot.release()
        raise
    shipped = None
    if state.settings.server.role == "prefill":  # the decode leg must find the prompts' blocks in the store
        async def shipped() -> None:
            await await_shipped(state, engine, tenant, prompts, cache_salt, public_lens)
    return Job(id=job_id, model=engine.model_name, fingerprint=state.fingerprint,
               engine=engine, tokenizer=engine.tokenizer, request_ids=request_ids, streams=streams,
               n=params[0].n, state=request.state,
               on_done=trace_recorder(request, prompts, tenant.salt, cache_salt), slot=slot, before_end=shipped)


async def _collected(request: Request, job: Job) -> tuple[list[list[str]], list[Any], list[Any]] | None:
    """The whole job's outputs (None if the client went away), after its ``before_end``."""
    try:
        result = await _until_disconnect(request, _collect(job))
    finally:  # also when the collecting task was cancelled before it ever ran
        job.abort()
        job.release()
    if result is not None and job.before_end is not None:
        await job.before_end()
    return result


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
