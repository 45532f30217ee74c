"""Engine output streams → OpenAI choices, usage and Server-Sent Events.

A `Job` is one HTTP request's worth of engine requests (one per prompt, each with `n` choices)::

    prompts:  p0            p1
    choices:  0 .. n-1      n .. 2n-1        (choice index = prompt index * n + delta.index)

`Job.outputs()` merges the engine streams, keeps the usage figures and aborts every unfinished
engine request when it is closed early: client disconnect, handler cancellation, error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from app.errors import error_body
from app.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from engine.errors import EngineError, EngineNotReadyError
from engine.outputs import RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(slots=True)
class Job:
    """The engine requests behind one HTTP request, and what they have produced so far."""

    id: str
    model: str
    fingerprint: str
    engine: Any
    tokenizer: Any
    request_ids: list[str]
    streams: Sequence[AsyncIterator[RequestOutput]]
    n: int
    state: Any  # request.state: usage and TTFT for the access log
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    cached_by_tier: list[dict[str, int]] = field(default_factory=list)
    completion_tokens: int = 0
    text_offsets: dict[int, int] = field(default_factory=dict)
    on_done: Callable[[Job], None] | None = None  # called once the outputs end (the request trace)
    # awaited after the last output, before the response ends (a prefill replica: app/disagg.py)
    before_end: Callable[[], Awaitable[None]] | None = None
    slot: Any = None  # the tenant's concurrency slot (tenants.limits.Slot), released when the job ends
    choice_tokens: list[int] = field(default_factory=list)
    _finished: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        count = len(self.streams)
        self.prompt_tokens, self.cached_tokens, self._finished = [0] * count, [0] * count, [False] * count
        self.cached_by_tier = [{} for _ in range(count)]
        self.choice_tokens = [0] * self.num_choices
        self.state.completion_id = self.id

    @property
    def num_choices(self) -> int:
        return self.n * len(self.streams)

    def abort(self) -> None:
        for request_id, finished in zip(self.request_ids, self._finished, strict=True):
            if not finished:
                self.engine.abort(request_id)

    def release(self) -> None:
        """Give the tenant's concurrency slot back (idempotent); the job's requests are over."""
        if self.slot is not None:
            self.slot.release()

    def output_tokens(self, index: int) -> int:
        """Tokens generated for prompt `index`: its longest choice."""
        return max(self.choice_tokens[index * self.n:(index + 1) * self.n])

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                         total_tokens=prompt + self.completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens),
                                                                   cached_tokens_per_tier=self.tier_totals()))

    def tier_totals(self) -> dict[str, int]:
        """The cached tokens of all prompts, per tier that served them."""
        totals: dict[str, int] = {}
        for split in self.cached_by_tier:
            for name, tokens in split.items():
                totals[name] = totals.get(name, 0) + tokens
        return totals

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs as the engine produces them; aborts leftovers on exit."""
        try:
            async for index, out in _merge(self.streams):
                self._account(index, out)
                yield index, out
        finally:
            self.abort()
            self.release()
            self.state.usage = {"prompt_tokens": sum(self.prompt_tokens),
                                "cached_tokens": sum(self.cached_tokens),
                                "completion_tokens": self.completion_tokens}
            if self.on_done is not None:
                try:
                    self.on_done(self)
                except Exception:
                    logger.exception("on_done failed completion_id=%s", self.id)

    def _account(self, index: int, out: RequestOutput) -> None:
        self.prompt_tokens[index] = out.metrics.prompt_tokens
        self.cached_tokens[index] = out.metrics.cached_tokens
        self.cached_by_tier[index] = out.metrics.cached_by_tier
        new_tokens = sum(len(delta.token_ids) for delta in out.outputs)
        if new_tokens and self.completion_tokens == 0 and getattr(self.state, "arrival", None):
            self.state.ttft_s = time.perf_counter() - self.state.arrival
        self.completion_tokens += new_tokens
        for delta in out.outputs:
            self.choice_tokens[index * self.n + delta.index] += len(delta.token_ids)
        if out.finished:
            self._finished[index] = True
        for delta in out.outputs:
            if delta.finish_reason == "abort":
                raise EngineNotReadyError("The request was aborted: the server is shutting down.")

    # ------------------------------------------------------------ logprobs in OpenAI shapes

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, choice: int, logprobs: list[TokenLogprob] | None) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        result = CompletionLogprobs()
        offset = self.text_offsets.get(choice, 0)
        for item in logprobs:
            token = self._token(item.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(item.logprob)
            result.text_offset.append(offset)
            top = {self._token(tid): lp for tid, lp in item.top}
            top.setdefault(token, item.logprob)
            result.top_logprobs.append(top)
            offset += len(token)
        self.text_offsets[choice] = offset
        return result

    def chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> ChatChoiceLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for item in logprobs:
            token = self._token(item.token_id)
            top = [TopLogprob(token=(t := self._token(tid)), logprob=lp, bytes=list(t.encode()))
                   for tid, lp in item.top]
            content.append(ChatTokenLogprob(token=token, logprob=item.logprob,
                                            bytes=list(token.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)


async def _merge(streams: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams in arrival order (a plain loop for one stream)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def sse(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def _finish(reason: str | None) -> Any:
    return reason if reason in ("stop", "length") else None


async def _guard(job: Job, chunks: AsyncIterator[str]) -> AsyncGenerator[str, None]:
    """Turn an error mid-stream into an SSE error event, always end with `[DONE]`."""
    try:
        async for chunk in chunks:
            yield chunk
    except EngineError as exc:
        job.state.stream_error = exc.status_code  # the access log's status (the 200 went out already)
        yield sse(error_body(exc.message, exc.error_type, exc.param, exc.code))
    except Exception:
        job.state.stream_error = 500
        logger.exception("stream failed completion_id=%s", job.id)
        yield sse(error_body("The server had an error while streaming.", "server_error"))
    else:
        if job.before_end is not None:
            await job.before_end()
    yield DONE
    job.state.stream_complete = True


async def _completion_chunks(job: Job, include_usage: bool) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}
    async for index, out in job.outputs():
        for delta in out.outputs:
            choice = index * job.n + delta.index
            chunk = CompletionResponse(
                id=job.id, created=job.created, model=job.model, system_fingerprint=job.fingerprint,
                choices=[CompletionChoice(index=choice, text=delta.text,
                                          logprobs=job.completion_logprobs(choice, delta.logprobs),
                                          finish_reason=_finish(delta.finish_reason))])
            yield sse(chunk, exclude)
    if include_usage:
        yield sse(CompletionResponse(id=job.id, created=job.created, model=job.model,
                                     system_fingerprint=job.fingerprint, choices=[], usage=job.usage()))


async def _chat_chunks(job: Job, include_usage: bool) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=job.id, created=job.created, model=job.model,
                                       system_fingerprint=job.fingerprint, choices=choices,
                                       usage=usage), exclude)

    for choice in range(job.num_choices):
        yield chunk([ChatStreamChoice(index=choice, delta=DeltaMessage(role="assistant", content=""))])
    async for index, out in job.outputs():
        for delta in out.outputs:
            content = delta.text if delta.text or not delta.finish_reason else None
            yield chunk([ChatStreamChoice(index=index * job.n + delta.index,
                                          delta=DeltaMessage(content=content),
                                          logprobs=job.chat_logprobs(delta.logprobs),
                                          finish_reason=_finish(delta.finish_reason))])
    if include_usage:
        yield chunk([], job.usage())


class EventStreamResponse(StreamingResponse):
    """SSE response that closes its generator when the client leaves, so aborts run at once.

    Starlette cancels the sending task on disconnect; a generator suspended at a `yield` would
    otherwise only be finalised by the garbage collector, keeping its engine requests alive.
    """

    def __init__(self, job: Job, chunks: AsyncIterator[str]) -> None:
        self._job = job
        self._chunks = _guard(job, chunks)
        super().__init__(self._chunks, media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not getattr(self._job.state, "stream_complete", False):
                self._job.state.disconnected = True
            await self._chunks.aclose()
            self._job.abort()  # a stream that never started has run no `outputs()` cleanup
            self._job.release()


def completion_stream(job: Job, include_usage: bool) -> StreamingResponse:
    return EventStreamResponse(job, _completion_chunks(job, include_usage))


def chat_stream(job: Job, include_usage: bool) -> StreamingResponse:
    return EventStreamResponse(job, _chat_chunks(job, include_usage))
