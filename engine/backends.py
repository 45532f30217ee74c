"""Where the step loop runs: a thread of this process, or an engine process of its own.

Both backends have one shape — ``start(on_event) -> EngineInfo`` (blocking: loads the model),
``send(command)``, ``close(timeout_s)`` — and deliver the loop's events to ``on_event`` from a
thread that is not the caller's (the frontend hops them onto its event loop).

`ProcessBackend` is how `kvgate serve` runs: the engine core loads and steps the model on the
main thread of a spawned process, so HTTP, JSON and detokenization in the API process never
hold the GIL the step loop needs, and the engine process has exactly one OpenMP pool. Commands
and events travel over two one-way pipes as pickled tuples of plain values; token ids, not text.
If the engine process dies, the event reader sees end-of-file and reports ``("dead", reason)``.
The engine process dies with the API process (end-of-file on its command pipe, and on Linux a
parent-death signal), so a killed server leaves no orphan.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from engine.config import EngineConfig
from engine.loop import Command, EngineInfo, EngineLoop, engine_info

logger = logging.getLogger(__name__)

OnEvent = Callable[[tuple[Any, ...]], None]
EXIT_CLOSE_S = 10.0  # how long an interpreter's exit waits for an engine process left open to stop


class EngineStartError(RuntimeError):
    """The engine could not load its model or its process died while starting."""


class ThreadBackend:
    """The step loop on a thread of this process that also loads the model (tests, benchmarks)."""

    kind = "thread"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core: Any = None  # the EngineCore, for in-process callers that inspect it
        self.tokenizer: Any = None
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, on_event: OnEvent) -> EngineInfo:
        handshake: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._commands = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, args=(on_event, handshake), name="kvgate-step",
                                        daemon=True)
        self._thread.start()
        result = handshake.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def _main(self, on_event: OnEvent, handshake: queue.SimpleQueue[Any]) -> None:
        from engine.core import EngineCore

        try:
            core = EngineCore(self.config)
        except BaseException as exc:
            handshake.put(exc)
            return
        self.core, self.tokenizer = core, core.loaded.tokenizer
        handshake.put(engine_info(core))
        EngineLoop(core, on_event).run(self._receive)

    def _receive(self, timeout: float) -> list[Command]:
        try:
            commands = [self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def send(self, command: Command) -> None:
        self._commands.put(command)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout_s: float = 30.0) -> None:
        if self._thread is not None:
            self._commands.put(("shutdown",))
            self._thread.join(timeout_s)
            self._thread = None


class ProcessBackend:
    """The step loop on the main thread of a spawned engine process."""

    kind = "process"

    def __init__(self, config: EngineConfig, initializer: Callable[..., None] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        self.config = config
        self.tokenizer: Any = None
        self.pid: int | None = None
        self._initializer = initializer
        self._initargs = initargs
        self._process: Any = None
        self._commands: Connection | None = None
        self._events: Connection | None = None
        self._reader: threading.Thread | None = None
        self._closing = False
        self._send_lock = threading.Lock()

    def start(self, on_event: OnEvent) -> EngineInfo:
        """Spawn the engine process, wait until its model is loaded, start the event reader."""
        from engine.model_source import load_tokenizer, resolve_model_path

        path = resolve_model_path(self.config.model)  # download/convert here, where progress is shown
        ctx = multiprocessing.get_context("spawn")
        commands_r, commands_w = ctx.Pipe(duplex=False)
        events_r, events_w = ctx.Pipe(duplex=False)
        process = ctx.Process(target=engine_process_main, name="kvgate-engine", daemon=True,
                              args=(self.config, commands_r, events_w, os.getpid(),
                                    self._initializer, self._initargs))
        process.start()
        commands_r.close()  # the child holds the only other ends: its death is end-of-file here
        events_w.close()
        self._process, self._commands, self._events, self._closing = process, commands_w, events_r, False
        self.pid = process.pid
        # an interpreter that exits with this backend open would hang: multiprocessing's own exit
        # hook sends the engine SIGTERM, which it turns into a drain request, and joins it forever.
        # Closing first (registered later, so run before that hook) flushes and stops it instead.
        atexit.register(self.close, EXIT_CLOSE_S)
        # the tokenizer (transformers: seconds of imports the first time, torch too unless it is
        # a Llama folder's generic one, engine.model_source) loads while the engine process
        # imports torch and loads the model, on the other core
        tokenizer: Future[Any] = Future()
        threading.Thread(target=_fill, args=(tokenizer, load_tokenizer, path), name="kvgate-tokenizer",
                         daemon=True).start()
        try:
            info = self._handshake(process, events_r)
            self.tokenizer = tokenizer.result()
        except BaseException:
            self._kill()
            raise
        self._reader = threading.Thread(target=self._read, args=(events_r, on_event), name="kvgate-events",
                                        daemon=True)
        self._reader.start()
        return info

    @staticmethod
    def _handshake(process: Any, events: Connection) -> EngineInfo:
        try:
            kind, payload = events.recv()
        except EOFError:
            process.join(5)
            raise EngineStartError(f"the engine process exited while loading the model "
                                   f"(exit code {process.exitcode}); see the log above") from None
        if kind == "error":
            raise EngineStartError(payload)
        assert kind == "ready", kind
        return payload

    def _read(self, events: Connection, on_event: OnEvent) -> None:
        while True:
            try:
                event = events.recv()
            except (EOFError, OSError):
                break
            on_event(event)
        if self._closing:
            return
        process = self._process
        if process is not None:
            process.join(2)
        code = process.exitcode if process is not None else None
        reason = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        on_event(("dead", reason))

    def send(self, command: Command) -> None:
        conn = self._commands
        if conn is None:
            return
        try:
            with self._send_lock:
                conn.send(command)
        except (OSError, ValueError):  # the process is gone; the reader reports it
            pass

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the engine process to stop, wait for it, kill it if it does not; reap it either way."""
        self._closing = True
        process = self._process
        if process is None:
            return
        self.send(("shutdown",))
        process.join(timeout_s)
        self._kill()

    def _kill(self) -> None:
        atexit.unregister(self.close)
        self._closing = True
        process = self._process
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(10)
        for conn in (self._commands, self._events):
            if conn is not None:
                conn.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        self._process = self._commands = self._events = self._reader = None


def _fill(future: Future[Any], fn: Callable[..., Any], *args: Any) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)


def engine_process_main(config: EngineConfig, commands: Connection, events: Connection, parent_pid: int,
                        initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
    """Entry point of the engine process: load, report, then run the step loop on this thread.

    SIGTERM and SIGINT do not stop this process: the first one is passed on to the API process
    as a ``("stop", signal name)`` event, which drains as if it had got the signal itself (it may
    well have: a process manager signals the whole group), then sends ``shutdown``, and the loop
    writes the cached blocks to disk before this process exits. Further signals are left to the
    API process, whose second signal exits at once (and this process with it)."""
    stop = _StopRequest()
    signal.signal(signal.SIGTERM, stop.handle)
    signal.signal(signal.SIGINT, stop.handle)
    _die_with_parent(parent_pid)
    if initializer is not None:
        initializer(*initargs)
    from engine.core import EngineCore

    try:
        core = EngineCore(config)
    except BaseException as exc:  # reported to the API process, which logs it and exits
        logging.getLogger(__name__).debug("engine failed to load", exc_info=True)
        events.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    events.send(("ready", engine_info(core)))

    def receive(timeout: float) -> list[Command]:
        received: list[Command] = []
        if stop.signal is not None and not stop.reported:
            stop.reported = True
            logging.getLogger(__name__).info("engine process got %s: asking the server to drain and stop", stop.signal)
            emit(("stop", stop.signal))
        try:
            if not commands.poll(timeout):
                return received
            while True:
                received.append(commands.recv())
                if not commands.poll(0):
                    return received
        except (EOFError, OSError):  # the API process is gone: stop
            received.append(("shutdown",))
            return received

    def emit(event: tuple[Any, ...]) -> None:
        try:
            events.send(event)
        except (OSError, ValueError):
            pass  # the API process is gone; the next receive sees it

    EngineLoop(core, emit).run(receive)
    logging.getLogger(__name__).info("engine process stopped")


class _StopRequest:
    """The first stop signal the engine process got (set by the handler, read by the loop)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.reported = False

    def handle(self, sig: int, frame: Any) -> None:
        if self.signal is None:
            self.signal = signal.Signals(sig).name


def _die_with_parent(parent_pid: int) -> None:
    """On Linux, ask the kernel to kill this process when its parent dies (even by SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the call: go now
        os._exit(0)

