"""A first start serves on PyTorch's ops while the native kernels compile in the background, then
switches to them between two steps: every step runs wholly on one set of ops, and the tokens are
the ones either path gives (tests/engine/test_kernels.py shows the two paths agree)."""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

import pytest

from engine import kernels
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loop import EngineLoop
from engine.outputs import GenerateRequest
from engine.packing import PackedLinear
from engine.sampling_params import SamplingParams

ops = kernels.load()
needs_ops = pytest.mark.skipif(ops is None, reason="the native ops cannot be built here (no C++ compiler)")


class FakeBuild:
    """A background build the test finishes by hand; `take` gives the real ops (or None: failed)."""

    def __init__(self, result: kernels.NativeOps | None) -> None:
        self.result = result
        self.finished = False
        self.cancelled = False
        self.taken_on: int | None = None
        self.seconds = 12.0

    def done(self) -> bool:
        return self.finished

    def take(self) -> kernels.NativeOps | None:
        self.taken_on = threading.get_ident()
        return self.result

    def cancel(self) -> None:
        self.cancelled = True


def _core(tiny_model_dir: Path, native: bool = True) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_model_dir), num_blocks=64, max_num_seqs=4, device="cpu",
                                   max_num_batched_tokens=64, native_kernels=native))


def _native_parts(core: EngineCore) -> tuple[bool, bool, bool, bool]:
    """Which parts of a step run native: attention, chunk attention, fused steps, packed matmuls."""
    runner = core.runner
    packed = [m for m in runner.modules() if isinstance(m, PackedLinear)]
    assert packed, "the tiny model has packed layers on CPU"
    panels = {m.panel is not None for m in packed}
    assert len(panels) == 1, "some packed layers have the panel kernel and some do not"
    assert runner.fast is not None
    return (runner.paged_kernel is not None, runner.chunk_kernel is not None, runner.fast.native is not None,
            panels.pop())


def _prompts() -> list[list[int]]:
    doc = [(7 * i) % 90 + 3 for i in range(70)]  # 70 tokens: two 64-token chunks, then decodes
    return [doc, doc[:40] + [5, 6, 7], [11, 12, 13]]


def _run_loop(core: EngineCore, flip_after_steps: int | None, build: FakeBuild | None) -> tuple[dict, list]:
    """Serve the prompts through the step loop; the build finishes after that many steps.
    Returns the tokens per request and, per step, the native parts at its start and at its end."""
    tokens: dict[str, list[int]] = {}
    parts: list[tuple[tuple[bool, ...], tuple[bool, ...]]] = []
    step = core.step

    def recorded_step():  # type: ignore[no-untyped-def]
        before = _native_parts(core)
        outputs = step()
        parts.append((before, _native_parts(core)))
        if build is not None and len(parts) == flip_after_steps:
            build.finished = True
        return outputs

    core.step = recorded_step  # type: ignore[method-assign]
    pending = [("add", GenerateRequest(str(i), ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)))
               for i, ids in enumerate(_prompts())]
    finished: set[str] = set()

    def emit(event):  # type: ignore[no-untyped-def]
        if event[0] == "out":
            for out in event[1]:
                tokens.setdefault(out.request_id, []).append(out.token_id)
                if out.finish_reason is not None:
                    finished.add(out.request_id)
        assert event[0] != "fail", event

    def receive(timeout: float):  # type: ignore[no-untyped-def]
        if pending:
            return [pending.pop(0)]
        if len(finished) == len(_prompts()):
            return [("shutdown",)]
        return []

    EngineLoop(core, emit).run(receive)
    return tokens, parts


@needs_ops
def test_serves_on_pytorch_then_switches_between_two_steps(tiny_model_dir, monkeypatch, caplog) -> None:
    reference, _ = _run_loop(_core(tiny_model_dir, native=False), None, None)

    build = FakeBuild(ops)
    monkeypatch.setattr(kernels, "load_or_build", lambda: (None, build))
    core = _core(tiny_model_dir)
    assert core.kernel_build is build and _native_parts(core) == (False, False, False, False)
    with caplog.at_level(logging.INFO, logger="engine.loop"):
        tokens, parts = _run_loop(core, 3, build)

    assert tokens == reference and len(tokens) == 3
    for before, after in parts:  # no step ran on a mix of the two, nor changed them while it ran
        assert before == after and len(set(before)) == 1, parts
    assert [before[0] for before, _ in parts] == [False] * 3 + [True] * (len(parts) - 3)
    assert build.taken_on == threading.get_ident()  # the loop's thread: the one that steps the model
    assert core.kernel_build is None and not build.cancelled
    assert "native CPU kernels in use from now on (compiled in 12 s in the background)" in caplog.text


@needs_ops
def test_a_build_that_fails_keeps_the_pytorch_path(tiny_model_dir, monkeypatch) -> None:
    build = FakeBuild(None)  # take() gives None: the compile failed or the self-check refused it
    monkeypatch.setattr(kernels, "load_or_build", lambda: (None, build))
    core = _core(tiny_model_dir)
    tokens, parts = _run_loop(core, 1, build)
    assert len(tokens) == 3 and build.taken_on is not None and core.kernel_build is None
    assert all(before == after == (False, False, False, False) for before, after in parts)


def test_an_engine_that_stops_first_cancels_its_build(tiny_model_dir, monkeypatch) -> None:
    build = FakeBuild(ops)
    monkeypatch.setattr(kernels, "load_or_build", lambda: (None, build))
    core = _core(tiny_model_dir)
    EngineLoop(core, lambda event: None).run(lambda timeout: [("shutdown",)])
    assert build.cancelled and build.taken_on is None


# ---- the background build itself, with a stand-in compiler -------------------------------------

_FAKE_CXX = """#!/bin/sh
# Stands in for g++: records its scheduling policy and niceness, then "compiles" (-c: an empty
# object) or "links" (-shared: a link to the real build, which the process has loaded already).
echo "$(chrt -p $$ 2>/dev/null | grep -o 'SCHED_[A-Z]*' | head -1) $(nice)" >> "{log}"
sleep {delay}
out=""; prev=""
for arg in "$@"; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done
case " $* " in
  *" -shared "*) ln -s "{real}" "$out" ;;
  *) : > "$out" ;;
esac
"""


@pytest.fixture()
def fake_compiler(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A private kernel folder, the module's state reset, and a stand-in compiler; returns a
    function that writes the compiler (with a delay) and gives the file it logs to."""
    real = kernels.build_dir() / "kvgate_kernels.so"  # the session's build (tests/conftest.py)
    monkeypatch.setenv("KVGATE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_building", {})

    def write(delay: float) -> Path:
        log, script = tmp_path / "cxx.log", tmp_path / "cxx"
        script.write_text(_FAKE_CXX.format(log=log, delay=delay, real=real))
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("CXX", str(script))
        return log

    yield write
    for build in list(kernels._building.values()):
        build.cancel()


@needs_ops
def test_background_build_runs_on_idle_cpu_and_loads_on_the_taking_thread(fake_compiler) -> None:
    log = fake_compiler(0)
    assert kernels._compiler() is not None
    first, build = kernels.load_or_build()
    assert first is None and build is not None
    assert kernels.load_or_build() == (None, build)  # engines of one process share one build
    assert build.wait(60) and build.error is None and build.seconds is not None
    folder = kernels.build_dir()
    assert (folder / "kvgate_kernels.so").exists()
    assert not list(folder.glob(".build-*"))  # the objects' temp folder is gone
    runs = [line.split() for line in log.read_text().splitlines()]
    assert len(runs) == len(kernels._SOURCES) + 1, runs  # each source and the link, at the lowest priority
    assert all(run[0] == "SCHED_IDLE" or int(run[-1]) >= 19 for run in runs), runs
    taken = build.take()
    assert taken is not None and taken.paged_attention is not None
    assert kernels.load_or_build() == (taken, None)  # from now on at once, from the cache of this process


def test_cancel_stops_the_compilers_and_leaves_nothing(fake_compiler) -> None:
    fake_compiler(120)
    _, build = kernels.load_or_build()
    assert build is not None
    for _ in range(500):  # until the compilers have started
        if len(build._processes) == min(4, os.cpu_count() or 1):
            break
        build.wait(0.01)
    processes = list(build._processes)
    assert processes
    build.cancel()
    assert build.done() and all(p.poll() is not None for p in processes)
    assert build.take() is None and "ops" not in kernels._loaded  # a later engine may build again
    folder = kernels.build_dir()
    assert not (folder / "kvgate_kernels.so").exists() and not list(folder.glob(".build-*"))
