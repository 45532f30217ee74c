"""ReaderPool: the threads that run a disk tier's blocking file reads, bounded, and never all
held by a stalled file.

A thread stuck in a read (a hung disk, a network folder gone away) cannot be stopped. The pool
stops counting it as a worker once its call is past ``stall_s``, counted from when the call was
submitted, as its caller's deadline is (a call that waited in the queue behind a stalled one is
stuck as soon as a thread takes it, if its caller has given up by then): the next call may start
a thread in its place, so ``workers`` threads keep serving — up to ``max_threads`` threads in all.
When every thread is stuck, a call fails at once (`ReadersStalled`) instead of queueing behind
them, and `stuck` says so (the tier reports itself unhealthy). A stuck thread that returns
serves again, or ends when the pool has enough without it; idle threads end after a while.
The threads are daemons: a stuck one must not keep the process from exiting.
"""

from __future__ import annotations

import errno
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

IDLE_EXIT_S = 30.0  # an idle thread ends after this long; the next call starts one again


class ReadersStalled(OSError):
    """Every reader thread is stuck in a call past the deadline: the read is not even queued."""

    def __init__(self, stuck: int, stall_s: float) -> None:
        super().__init__(errno.EBUSY, f"all {stuck} disk reader threads are stuck for over {stall_s:g} s")


class ReaderPool:
    def __init__(self, workers: int, max_threads: int, stall_s: float, name: str = "kvgate-read") -> None:
        if not 1 <= workers <= max_threads or stall_s <= 0:
            raise ValueError(f"need 1 <= workers <= max_threads and stall_s > 0, got {workers}, {max_threads}, {stall_s}")
        self.workers = workers
        self.max_threads = max_threads
        self.stall_s = stall_s
        self.name = name
        self._lock = threading.Lock()
        # (future, function, arguments, when submitted (monotonic))
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], float]] = \
            queue.SimpleQueue()
        self._started: dict[int, float] = {}  # busy thread → when its call was submitted (monotonic)
        self._threads = 0
        self._count = 0  # threads ever started, for their names

    def _stuck(self, now: float) -> int:
        return sum(1 for submitted in self._started.values() if now - submitted > self.stall_s)

    @property
    def stuck(self) -> int:
        """Threads in a call submitted more than ``stall_s`` ago."""
        with self._lock:
            return self._stuck(time.monotonic())

    @property
    def threads(self) -> int:
        with self._lock:
            return self._threads

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on a reader thread; a future of its result. Cancelling the future
        before a thread takes the call drops it. Raises `ReadersStalled` when every thread is stuck."""
        future: Future[Any] = Future()
        with self._lock:
            now = time.monotonic()
            stuck = self._stuck(now)
            serving = self._threads - stuck
            if serving <= 0 and self._threads >= self.max_threads:
                raise ReadersStalled(stuck, self.stall_s)
            self._jobs.put((future, fn, args, now))
            if serving < self.workers and self._threads < self.max_threads:
                self._threads += 1
                self._count += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._count}", daemon=True).start()
        return future

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            try:
                future, fn, args, submitted = self._jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if not self._jobs.empty():  # a call came in meanwhile, counting on this thread
                        continue
                    self._threads -= 1
                return
            if not future.set_running_or_notify_cancel():  # its caller gave up before it started
                continue
            with self._lock:
                self._started[me] = submitted
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
            with self._lock:
                del self._started[me]
                if self._threads - self._stuck(time.monotonic()) > self.workers:  # a stuck one came back
                    self._threads -= 1
                    return
