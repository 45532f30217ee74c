"""RequestStreams: the API side's in-flight requests, each with its output queue and detokenizers.

Engine outputs arrive one token per sequence per step; here they become ``RequestOutput`` deltas:
text detokenized incrementally, stop strings applied, metrics filled, and a request's stream
closed once all of its ``n`` choices finished. Runs on the event loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import (
    CompletionDelta,
    GenerateRequest,
    RequestMetrics,
    RequestOutput,
    SeqOutput,
    TokenLogprob,
)


@dataclass(slots=True)
class _Choice:
    detok: IncrementalDetokenizer
    finished: bool = False
    num_tokens: int = 0


@dataclass(slots=True)
class _RequestState:
    queue: asyncio.Queue
    choices: list[_Choice]
    metrics: RequestMetrics


class RequestStream:
    """Async iterator of one request's outputs; ends after the output marked ``finished``."""

    def __init__(self, request_id: str, q: asyncio.Queue) -> None:
        self.request_id = request_id
        self._queue = q
        self._done = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item


class RequestStreams:
    """The requests in flight by id; a request leaves when it finishes, is aborted or fails."""

    def __init__(self) -> None:
        self._states: dict[str, _RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    @property
    def num_active_sequences(self) -> int:
        """Sequences of the requests in flight that have not finished (running or waiting)."""
        return sum(not c.finished for state in self._states.values() for c in state.choices)

    def add(self, request: GenerateRequest, tokenizer: Any) -> RequestStream:
        """Register a request (one detokenizer per choice) and return the stream it is read from."""
        params = request.params
        q: asyncio.Queue = asyncio.Queue()
        choices = [_Choice(IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.stop))
                   for _ in range(params.n)]
        metrics = RequestMetrics(prompt_tokens=len(request.prompt_token_ids), arrival_time=time.monotonic())
        self._states[request.request_id] = _RequestState(q, choices, metrics)
        return RequestStream(request.request_id, q)

    def abort(self, request_id: str) -> None:
        """End a request's stream with an "abort" delta for each choice still running."""
        state = self._states.pop(request_id, None)
        if state is None:
            return
        deltas = [CompletionDelta(i, [], "", None, "abort")
                  for i, c in enumerate(state.choices) if not c.finished]
        state.metrics.finished_time = time.monotonic()
        state.queue.put_nowait(RequestOutput(request_id, deltas, state.metrics, finished=True))

    def fail(self, request_id: str, exc: BaseException) -> None:
        """End a request's stream by raising ``exc`` in its reader."""
        state = self._states.pop(request_id, None)
        if state is not None:
            state.queue.put_nowait(exc)

    def fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._states):
            self.fail(request_id, exc)

    def dispatch(self, outputs: list[SeqOutput], stop_choice: Callable[[str, int], None]) -> None:
        """Turn one step's outputs into one ``RequestOutput`` per request.

        ``stop_choice(request_id, index)`` is called for a choice that a stop string ended while
        the engine would go on generating it.
        """
        now = time.monotonic()
        by_request: dict[str, list[CompletionDelta]] = {}
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue
            choice = state.choices[out.index]
            if choice.finished:
                continue
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if out.index == 0 and choice.num_tokens == 0:  # siblings hit choice 0's prompt blocks
                metrics.cached_tokens = out.num_cached_tokens
                if out.cached_by_tier is not None:
                    metrics.cached_by_tier = out.cached_by_tier
            choice.num_tokens += 1
            metrics.completion_tokens += 1
            metrics.token_times.append(now)
            text = choice.detok.add([out.token_id])
            reason = out.finish_reason
            if choice.detok.stopped:
                if reason is None:
                    stop_choice(out.request_id, out.index)
                reason = "stop"
            elif reason is not None:
                text += choice.detok.finish()
                if choice.detok.stopped:  # the flushed tail completed a stop string
                    reason = "stop"
            if reason is not None:
                choice.finished = True
            logprobs: list[TokenLogprob] | None = [out.logprob] if out.logprob is not None else None
            by_request.setdefault(out.request_id, []).append(
                CompletionDelta(out.index, [out.token_id], text, logprobs, reason))  # type: ignore[arg-type]
        for request_id, deltas in by_request.items():
            state = self._states[request_id]
            finished = all(c.finished for c in state.choices)
            if finished:
                state.metrics.finished_time = now
                del self._states[request_id]
            state.queue.put_nowait(RequestOutput(request_id, deltas, state.metrics, finished=finished))
