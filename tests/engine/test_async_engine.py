"""AsyncEngine: the step thread, asyncio streams, stop strings, abort and shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import EngineNotReadyError, EngineOverloadedError, InvalidRequestError
from engine.model import load_model
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


async def started(model_dir: Path, **overrides) -> AsyncEngine:
    kwargs = dict(model=str(model_dir), block_size=4, num_blocks=256)
    kwargs.update(overrides)
    engine = AsyncEngine.from_config(EngineConfig(**kwargs))
    engine.start()
    return engine


async def collect(engine: AsyncEngine, request: GenerateRequest):
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}
    last = None
    async for out in engine.generate(request):
        for d in out.outputs:
            texts[d.index] = texts.get(d.index, "") + d.text
            tokens.setdefault(d.index, []).extend(d.token_ids)
            reasons[d.index] = d.finish_reason
        last = out
    return texts, tokens, reasons, last


def test_concurrent_streams_match_generate(tiny_model_dir):
    ref = load_model(str(tiny_model_dir))
    prompts = [ref.tokenizer(f"stream {i} " * (i + 1)).input_ids for i in range(8)]

    async def main():
        engine = await started(tiny_model_dir)
        try:
            results = await asyncio.gather(*[
                collect(engine, GenerateRequest(f"s{i}", p, SamplingParams(max_tokens=10, temperature=0,
                                                                              ignore_eos=True)))
                for i, p in enumerate(prompts)])
            assert (await engine.stats())["blocks_in_use"] == 0
            return results
        finally:
            await engine.shutdown()

    results = run(main())
    for ids, (texts, tokens, reasons, last) in zip(prompts, results, strict=True):
        with torch.no_grad():
            expected = ref.model.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10,
                                          do_sample=False)[0, len(ids):].tolist()
        assert tokens[0] == expected
        assert texts[0] == ref.tokenizer.decode(expected, skip_special_tokens=True)
        assert reasons[0] == "length"
        assert last.finished and last.metrics.completion_tokens == 10
        assert last.metrics.ttft_s is not None and last.metrics.ttft_s >= 0
        assert len(last.metrics.token_times) == 10
        assert last.metrics.token_times == sorted(last.metrics.token_times)
        assert last.metrics.token_times[0] == last.metrics.first_token_time
        assert last.metrics.tpot_s is not None and last.metrics.tpot_s >= 0


def test_stop_string_ends_choice_and_frees(tiny_model_dir):
    ref = load_model(str(tiny_model_dir))
    ids = ref.tokenizer("tell me a story").input_ids
    with torch.no_grad():
        expected = ref.model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                                      do_sample=False)[0, len(ids):].tolist()
    full = ref.tokenizer.decode(expected, skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip() and stop in full

    async def main():
        engine = await started(tiny_model_dir)
        try:
            out = await collect(engine, GenerateRequest(
                "stop", ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])))
            for _ in range(200):  # the stop reaches the step thread as a command: poll briefly
                if (await engine.stats())["blocks_in_use"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await engine.stats())["blocks_in_use"] == 0
            return out
        finally:
            await engine.shutdown()

    texts, _, reasons, _ = run(main())
    assert texts[0] == full[: full.index(stop)]
    assert reasons[0] == "stop"


def test_abort_mid_stream_frees_blocks(tiny_model_dir):
    async def main():
        engine = await started(tiny_model_dir)
        try:
            stream = engine.add_request(GenerateRequest(
                "long", [5, 6, 7, 8, 9], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)))
            got = 0
            async for out in stream:
                got += len(out.outputs[0].token_ids)
                if got >= 3:
                    break
            assert (await engine.stats())["blocks_in_use"] > 0
            engine.abort("long")
            engine.abort("long")  # idempotent
            for _ in range(100):
                if (await engine.stats())["blocks_in_use"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await engine.stats())["blocks_in_use"] == 0
            assert (await engine.stats())["num_streams"] == 0
        finally:
            await engine.shutdown()

    run(main())


def test_errors_before_allocation_and_after_shutdown(tiny_model_dir):
    async def main():
        engine = await started(tiny_model_dir, max_queue=1, max_num_seqs=1)
        try:
            with pytest.raises(InvalidRequestError):
                engine.add_request(GenerateRequest("empty", [], SamplingParams()))
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            engine.add_request(GenerateRequest("a", [1, 2, 3], long))  # runs (max_num_seqs = 1)
            engine.add_request(GenerateRequest("b", [1, 2, 3], long))  # waits (max_queue = 1)
            with pytest.raises(EngineOverloadedError):
                engine.add_request(GenerateRequest("c", [1, 2, 3], long))
            with pytest.raises(InvalidRequestError):
                engine.add_request(GenerateRequest("a", [1, 2, 3], long))
        finally:
            await engine.shutdown(timeout_s=0.1)
        assert not engine.ready
        with pytest.raises(EngineNotReadyError):
            engine.add_request(GenerateRequest("late", [1, 2, 3], SamplingParams()))
        assert (await engine.stats())["blocks_in_use"] == 0

    run(main())


def test_the_model_loads_and_steps_on_one_thread_not_the_callers(tiny_model_dir):
    """One OpenMP pool per process: the thread that built the core is the only one stepping it."""
    import threading

    async def main():
        engine = await started(tiny_model_dir)
        try:
            await collect(engine, GenerateRequest("t", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
            threads = (await engine.stats())["engine_threads"]
        finally:
            await engine.shutdown()
        assert threads["step"] == threads["owner"] != threading.get_ident()

    run(main())


def test_stepping_from_another_thread_is_refused(tiny_model_dir):
    import threading

    from engine.core import EngineCore

    core = EngineCore(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=16))
    core.add_request(GenerateRequest("x", [1, 2, 3], SamplingParams(max_tokens=1)))
    errors: list[BaseException] = []

    def step() -> None:
        try:
            core.step()
        except AssertionError as exc:
            errors.append(exc)

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert errors and "thread that built it" in str(errors[0])
    assert core.step()  # the owner thread steps fine


class _FakeBackend:
    """A backend whose engine 'dies' on demand: tests the restart policy without processes."""

    kind = "fake"

    def __init__(self, fail_start_after: int | None = None) -> None:
        self.tokenizer = None
        self.starts = 0
        self.fail_start_after = fail_start_after

    def start(self, on_event):
        from engine.limits import RequestLimits
        from engine.loop import EngineInfo

        self.starts += 1
        if self.fail_start_after is not None and self.starts > self.fail_start_after:
            raise RuntimeError("cannot start")
        return EngineInfo("fake", "/fake", b"f" * 32, RequestLimits(100, 64, 4, 16), 4, self.starts, 0)

    def send(self, command) -> None:
        pass

    def close(self, timeout_s: float = 0) -> None:
        pass


def test_a_dead_engine_is_restarted_and_after_too_many_deaths_the_server_is_told(monkeypatch):
    async def main():
        backend = _FakeBackend()
        engine = AsyncEngine(backend, max_restarts=2)
        fatal: list[BaseException] = []
        engine.on_fatal = fatal.append
        engine.load()
        engine.start()
        for expected_starts in (2, 3):
            engine._handle_event(("dead", "killed by signal 9"))
            assert not engine.ready and engine.status == "restarting"
            await engine._restart_task
            assert engine.ready and backend.starts == expected_starts and not fatal
        engine._handle_event(("dead", "killed by signal 9"))  # third death within the window
        await engine._restart_task
        assert not engine.ready and engine.status == "failed" and backend.starts == 3
        assert fatal and "3 times" in str(fatal[0])

    run(main())


def test_a_restart_that_cannot_start_tells_the_server():
    async def main():
        engine = AsyncEngine(_FakeBackend(fail_start_after=1))
        fatal: list[BaseException] = []
        engine.on_fatal = fatal.append
        engine.load()
        engine.start()
        engine._handle_event(("dead", "exit code 1"))
        await engine._restart_task
        assert fatal and "cannot start" in str(fatal[0]) and engine.status == "failed"

    run(main())


def test_a_stop_signal_of_the_engine_reaches_on_stop_even_before_start(tiny_model_dir):
    """The engine process reports SIGTERM/SIGINT as a ("stop", name) event; one that arrives
    while the model loads (before `start`) is acted on when serving starts."""
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=64))
    seen: list[str] = []
    engine.on_stop = seen.append
    engine._on_event(("stop", "SIGTERM"))  # as the event reader thread delivers it, before start()

    async def main():
        engine.start()
        try:
            await asyncio.sleep(0.05)
            assert seen == ["SIGTERM"]
            engine._on_event(("stop", "SIGINT"))  # after start: hopped onto the loop
            await asyncio.sleep(0.05)
            assert seen == ["SIGTERM", "SIGINT"]
        finally:
            await engine.shutdown()

    run(main())
