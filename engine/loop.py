"""The step loop: commands in, step outputs out, on the one thread that built the EngineCore.

Both engine backends run this loop: `ThreadBackend` on a thread of the API process (tests,
benchmarks), `ProcessBackend` on the main thread of the engine process (serving). Loading the
model and stepping it on one thread is what keeps one OpenMP pool in the process (two pools on
two cores throttle every parallel region; see docs/serving.md).

Commands (tuples, first element the kind):
    ("add", GenerateRequest)   ("abort", request_id)   ("stop_choice", request_id, index)
    ("stats", token)           ("tiers", token, action, tier, options)   ("shutdown",)
    ("cache", token, CacheCommand)
Events out, through the `emit` callable:
    ("out", list[SeqOutput])   ("fail", request_id, FailInfo)   ("reply", token, value)

A cache control command (engine/cache_control.py) runs here between steps; the tier I/O it needs
runs on the chain's I/O thread, which sends the reply itself when done: `emit` takes a lock, so
the two threads never interleave their events on the way out.

On a machine without a build of the native CPU kernels the engine starts on PyTorch's ops while
the compiler runs in the background (engine.kernels.KernelBuild); between two steps, once it is
done, the loop loads and self-checks the build here and switches every part of the step to it
at once (`ModelRunner.use_native`), so no step runs on half of each.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError, InvalidRequestError
from engine.limits import RequestLimits

if TYPE_CHECKING:  # the core (torch, the model) loads where the loop runs, not where it is started
    from engine.core import EngineCore

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle loop blocks waiting for a command before looking again
LOAD_POLL_S = 0.002  # while requests wait on disk loads and nothing else runs

Command = tuple[Any, ...]
Emit = Callable[[tuple[Any, ...]], None]
Receive = Callable[[float], list[Command]]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the serving side needs to know about a loaded engine; plain values, picklable."""

    model_name: str
    model_path: str
    fingerprint: bytes
    limits: RequestLimits
    max_num_seqs: int
    pid: int
    thread_id: int


@dataclass(frozen=True, slots=True)
class FailInfo:
    """Why a request failed inside the engine, as plain values (exceptions do not pickle well)."""

    message: str
    invalid: bool = False
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> FailInfo:
        if isinstance(exc, InvalidRequestError):
            return cls(exc.message, True, exc.param, exc.code)
        return cls(f"engine error: {type(exc).__name__}: {exc}")

    def error(self) -> EngineError:
        if self.invalid:
            return InvalidRequestError(self.message, param=self.param, code=self.code)
        return EngineError(self.message)


def engine_info(core: EngineCore) -> EngineInfo:
    return EngineInfo(
        model_name=core.loaded.name, model_path=core.loaded.path,
        fingerprint=core.fingerprint, limits=core.limits, max_num_seqs=core.config.max_num_seqs,
        pid=os.getpid(), thread_id=threading.get_ident())


class EngineLoop:
    """Applies commands and steps the core until told to shut down (or its input ends)."""

    def __init__(self, core: EngineCore, emit: Emit) -> None:
        self.core = core
        self._emit = emit
        self._emit_lock = threading.Lock()

    def emit(self, event: tuple[Any, ...]) -> None:
        """Send an event out (from the step loop, or the chain's I/O thread for a cache reply)."""
        with self._emit_lock:
            self._emit(event)

    def run(self, receive: Receive) -> None:
        """Loop until a ``shutdown`` command; ``receive(timeout)`` returns the pending commands."""
        core = self.core
        try:
            while True:
                timeout = 0.0 if core.has_work() else LOAD_POLL_S if core.is_loading() else IDLE_WAIT_S
                for command in receive(timeout):
                    if not self.handle(command):
                        self._abort_all()
                        return
                core.poll_loads()
                self.switch_kernels()
                if core.has_work():
                    self.step()
        finally:
            build = getattr(core, "kernel_build", None)
            if build is not None:  # stopped before the kernels were built: stop the compiler too
                build.cancel()
            core.close()

    def switch_kernels(self) -> bool:
        """Between two steps: once the background build of the native kernels is done, load and
        self-check it on this thread (it runs torch ops, like every step) and run the next steps
        on it. True when the kernels were switched in by this call."""
        build = getattr(self.core, "kernel_build", None)
        if build is None or not build.done():
            return False
        self.core.kernel_build = None
        ops = build.take()  # None: the build failed or computes wrong values (logged); PyTorch stays
        if ops is None:
            return False
        self.core.runner.use_native(ops)
        logger.info("native CPU kernels in use from now on (compiled in %.0f s in the background); "
                    "later starts on this machine load them at once", build.seconds or 0.0)
        return True

    def handle(self, command: Command) -> bool:
        """Apply one command; False means shut down."""
        kind = command[0]
        try:
            if kind == "add":
                self.core.add_request(command[1])
            elif kind == "abort":
                self.core.abort_request(command[1])
            elif kind == "stop_choice":
                self.core.abort_sequence(command[1], command[2], "stop")
            elif kind == "stats":
                self.emit(("reply", command[1], self.core.stats()))
            elif kind == "tiers":
                try:
                    tiers = self.core.configure_tier(command[2], command[3], command[4])
                    self.emit(("reply", command[1], {"ok": True, "tiers": tiers}))
                except (ValueError, OSError) as exc:
                    self.emit(("reply", command[1], {"ok": False, "error": str(exc)}))
            elif kind == "cache":
                token = command[1]
                self.core.cache_control(command[2], lambda value: self.emit(("reply", token, value)))
            elif kind == "shutdown":
                return False
            else:
                logger.error("unknown engine command %r", kind)
        except Exception as exc:  # a request that fails here must not take the loop down
            logger.exception("engine command %s failed", kind)
            if kind == "add":
                self.emit(("fail", command[1].request_id, FailInfo.of(exc)))
            elif kind == "cache":  # the caller waits for an answer: give it the error
                self.emit(("reply", command[1], {"ok": False, "status": 500, "code": "engine_error", "param": None,
                                                 "message": f"engine error: {type(exc).__name__}: {exc}"}))
        return True

    def step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:
            logger.exception("engine step failed; aborting the requests in flight")
            info = FailInfo.of(exc)
            for request_id in self._abort_all():
                self.emit(("fail", request_id, info))
            return
        if outputs:
            self.emit(("out", outputs))

    def _abort_all(self) -> list[str]:
        request_ids = list(self.core.request_ids())
        for request_id in request_ids:
            self.core.abort_request(request_id)
        return request_ids
