"""Drive an `EngineCore` as its loop does: admit finished prefetches, step, wait on reads."""

from __future__ import annotations

import time
from collections.abc import Iterator

from engine.core import EngineCore
from engine.outputs import SeqOutput


def outputs(core: EngineCore) -> Iterator[SeqOutput]:
    """Every output until no request is left running or loading (then asserts the engine is idle)."""
    for _ in range(100_000):
        if not (core.has_work() or core.is_loading()):
            break
        core.poll_loads()
        if not core.has_work():
            time.sleep(0.001)  # waiting on disk or remote reads, as the engine loop does
            continue
        yield from core.step()
    assert not core.has_work() and not core.is_loading(), "the engine did not finish its requests"
