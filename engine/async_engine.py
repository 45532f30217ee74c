"""AsyncEngine: EngineCore's step loop on a background thread, token streams out via asyncio.

    event loop thread                          step thread
    add_request ─ validate ─▶ commands ───────▶ drain → core.step() → outputs
    RequestStream ◀─ detokenize, stop strings ◀── call_soon_threadsafe(dispatch)

The HTTP layer only sees this class: ``add_request`` raises typed errors before anything is
allocated, the returned stream yields ``RequestOutput`` deltas, ``abort`` frees blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore, SeqOutput
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import EngineNotReadyError, EngineOverloadedError, InvalidRequestError
from engine.outputs import CompletionDelta, GenerateRequest, RequestMetrics, RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)


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


class AsyncEngine:
    """Serves many concurrent requests from one EngineCore stepping on its own thread."""

    def __init__(self, core: EngineCore, max_queue: int = 256) -> None:
        self.core = core
        self.max_queue = max_queue
        self.tokenizer = core.loaded.tokenizer
        self.model_name = core.config.served_model_name or core.loaded.name
        self.max_model_len = core.max_model_len
        self.fingerprint: bytes = core.fingerprint
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _RequestState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running = False
        self._accepting = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model and build the engine (blocking: seconds to minutes)."""
        return cls(EngineCore(config), max_queue=config.max_queue)

    @property
    def ready(self) -> bool:
        return self._running and self._accepting

    def start(self) -> None:
        """Start the step thread; call from the event loop that will consume the streams."""
        if self._running:
            return
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="kvgate-step", daemon=True)
        self._thread.start()

    # ---- requests (event loop thread) -------------------------------------------------------
    def add_request(self, request: GenerateRequest) -> RequestStream:
        """Validate and enqueue a request; raises a typed error before anything is allocated."""
        if not self.ready:
            raise EngineNotReadyError("the engine is not accepting requests (starting or shutting down)")
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", param="request_id")
        self.core.validate(request)
        # Requests beyond the running capacity (max_num_seqs) count as waiting. Deciding from the
        # loop thread's own bookkeeping keeps the limit exact: the step thread's view lags a step.
        waiting = len(self._streams) - self.core.config.max_num_seqs
        if waiting >= self.max_queue:
            raise EngineOverloadedError(
                f"{waiting} requests are already waiting beyond the {self.core.config.max_num_seqs} running "
                f"(server.max_queue = {self.max_queue}); retry shortly")
        params = request.params
        q: asyncio.Queue = asyncio.Queue()
        choices = [_Choice(IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop))
                   for _ in range(params.n)]
        metrics = RequestMetrics(prompt_tokens=len(request.prompt_token_ids), arrival_time=time.monotonic())
        self._streams[request.request_id] = _RequestState(q, choices, metrics)
        self._send(("add", request))
        return RequestStream(request.request_id, q)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Convenience wrapper: add the request and yield its outputs, aborting if cancelled."""
        stream = self.add_request(request)
        try:
            async for out in stream:
                yield out
        finally:
            self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; idempotent, safe after it finished."""
        state = self._streams.pop(request_id, None)
        if state is None:
            return
        self._send(("abort", request_id))
        deltas = [CompletionDelta(i, [], "", None, "abort")
                  for i, c in enumerate(state.choices) if not c.finished]
        state.metrics.finished_time = time.monotonic()
        state.queue.put_nowait(RequestOutput(request_id, deltas, state.metrics, finished=True))

    def stats(self) -> dict[str, Any]:
        """Queue, pool and cache figures (see ``EngineCore.stats``) plus in-flight streams."""
        snapshot = self.core.stats()
        snapshot["num_streams"] = len(self._streams)
        return snapshot

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``timeout_s``, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._running = False
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)
            self._thread = None

    # ---- step thread ------------------------------------------------------------------------
    def _send(self, command: tuple[Any, ...]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            try:
                if kind == "add":
                    self.core.add_request(command[1])
                elif kind == "abort":
                    self.core.abort_request(command[1])
                elif kind == "stop_choice":
                    self.core.abort_sequence(command[1], command[2], "stop")
            except Exception as exc:  # a request that fails here must not take the loop down
                logger.exception("engine command %s failed", kind)
                if kind == "add":
                    self._post(self._fail, command[1].request_id, exc)

    def _run(self) -> None:
        while self._running:
            self._drain()
            if not self.core.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.core.step()
            except Exception as exc:
                logger.exception("engine step failed; aborting the requests in flight")
                for request_id in list(self.core._requests):
                    self.core.abort_request(request_id)
                    self._post(self._fail, request_id, exc)
                continue
            if outputs:
                self._post(self._dispatch, outputs)
        self._drain()  # aborts sent by shutdown free their blocks before the thread exits

    def _post(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call
                pass

    # ---- event loop side ----------------------------------------------------------------------
    def _fail(self, request_id: str, exc: BaseException) -> None:
        state = self._streams.pop(request_id, None)
        if state is not None:
            state.queue.put_nowait(exc)

    def _dispatch(self, outputs: list[SeqOutput]) -> None:
        now = time.monotonic()
        by_request: dict[str, list[CompletionDelta]] = {}
        for out in outputs:
            state = self._streams.get(out.request_id)
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
            choice.num_tokens += 1
            metrics.completion_tokens += 1
            metrics.token_times.append(now)
            text = choice.detok.add([out.token_id])
            reason = out.finish_reason
            if choice.detok.stopped:
                if reason is None:
                    self._send(("stop_choice", out.request_id, out.index))
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
            state = self._streams[request_id]
            finished = all(c.finished for c in state.choices)
            if finished:
                state.metrics.finished_time = now
                del self._streams[request_id]
            state.queue.put_nowait(RequestOutput(request_id, deltas, state.metrics, finished=finished))
