"""`ProcessBackend.start` loads the API process's tokenizer while the engine process starts; a
tokenizer that fails there fails the start as it did when it loaded after the engine: the error
reaches the caller and the engine process is gone. (Every `kvgate serve` test covers the start
that succeeds.)"""

from __future__ import annotations

from pathlib import Path

import pytest

import engine.model_source
from engine.backends import ProcessBackend
from engine.config import EngineConfig


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
