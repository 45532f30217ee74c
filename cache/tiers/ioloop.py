"""The chain's I/O thread: an asyncio loop, plus writer and sender threads below the step loop's
CPU priority, and an idle writer that runs only on CPU nobody else wants."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

# How much lower than the step loop the background writers run (Linux `nice`): writes are
# demotions and write-throughs nobody waits for, and on a small machine every core they take is
# taken from the step's OpenMP threads, which then also wait for each other at every barrier.
# At +10 a writer gets about a tenth of a busy core's share and still keeps up with serving's
# write rates (docs/tiers.md, "Not built yet", has what it costs a step beside a write-through).
BACKGROUND_NICE = 10


def _deprioritise() -> None:
    """Lower the calling thread's CPU priority by `BACKGROUND_NICE` (where the OS allows it)."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + BACKGROUND_NICE))
    except (AttributeError, OSError):  # not Linux, or not permitted: the writes run at normal priority
        pass


def _idle_only() -> None:
    """Run the calling thread only when a CPU would otherwise idle (Linux `SCHED_IDLE`); where
    the OS has no such class or refuses it, at the lowest nice level instead."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass


class IOLoop:
    """An asyncio event loop on a daemon thread; coroutines are submitted from other threads.

    Below normal CPU priority, for the work nobody waits for: ``writer`` (2 threads) writes disk
    files, ``sender`` (1 thread) sends remote writes' bytes — apart, so that a slow ``fsync``
    never holds a write-through other replicas are waiting to see. ``idle_writer`` (1 thread)
    writes what ``persist = "idle"`` writes behind: only while a CPU is idle, so while the step
    loop keeps every core busy it writes (almost) nothing. Reads stay on the loop and its
    default executor, at normal priority: a request waits for them."""

    def __init__(self, name: str = "kvgate-io") -> None:
        self.loop = asyncio.new_event_loop()
        self.writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{name}-write",
                                         initializer=_deprioritise)
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-send",
                                         initializer=_deprioritise)
        self.idle_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-idle",
                                              initializer=_idle_only)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _shutdown(self) -> None:
        """Cancel the reads and writes still queued or in flight and let them unwind here, on their
        own loop, then stop. Abandoned with the loop, they would be finalised later by the garbage
        collector on whichever thread runs it, where aiofiles' clean-up submits to that thread's
        loop's executor, which can deadlock it (seen with a second chain's I/O thread)."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()

    def close(self) -> None:
        if self.thread.is_alive():
            self.submit(self._shutdown())
        self.thread.join(10)
        if not self.loop.is_running():
            self.loop.close()
        self.writer.shutdown(wait=False, cancel_futures=True)
        self.sender.shutdown(wait=False, cancel_futures=True)
        self.idle_writer.shutdown(wait=False, cancel_futures=True)
