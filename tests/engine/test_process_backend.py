"""`ProcessBackend.start` loads the API process's tokenizer while the engine process starts; a
tokenizer that fails there fails the start as it did when it loaded after the engine: the error
reaches the caller and the engine process is gone. (Every `kvgate serve` test covers the start
that succeeds.) An interpreter that exits with a backend still open stops its engine process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import engine.model_source
from engine.backends import ProcessBackend
from engine.config import EngineConfig
from tests.app.conftest import ROOT


@pytest.mark.server  # spawns the engine process
def test_a_tokenizer_that_fails_in_the_api_process_fails_the_start_and_leaves_no_engine(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path: str) -> None:
        raise OSError(f"no tokenizer in {path}")

    monkeypatch.setattr(engine.model_source, "load_tokenizer", broken)
    backend = ProcessBackend(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    events: list[tuple] = []
    try:
        with pytest.raises(OSError, match=f"no tokenizer in {tiny_model_dir}"):
            backend.start(events.append)
        assert backend.pid is not None and not Path(f"/proc/{backend.pid}").exists()
        assert not backend.alive and backend.tokenizer is None and events == []
    finally:
        backend.close(5.0)  # where the start wrongly succeeded: an engine left running would hang pytest's exit


_LEFT_OPEN = """
import sys
from engine.backends import ProcessBackend
from engine.config import EngineConfig

backend = ProcessBackend(EngineConfig(model=sys.argv[1], num_blocks=64))
backend.start(lambda event: None)
print(backend.pid, flush=True)
"""


@pytest.mark.server  # a Python interpreter that spawns the engine process
def test_an_interpreter_that_exits_with_the_engine_open_stops_it_instead_of_hanging(tiny_model_dir: Path) -> None:
    """multiprocessing's exit hook alone would SIGTERM the engine (which turns the signal into a
    drain request for an API process that no longer listens) and join it forever."""
    try:
        result = subprocess.run([sys.executable, "-c", _LEFT_OPEN, str(tiny_model_dir)], cwd=ROOT,
                                capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the interpreter hung at exit with its engine process open: {exc.stderr!r}")
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.split()[0])
    assert not Path(f"/proc/{pid}").exists(), "the engine process outlived the interpreter"
