"""Shared fixtures: one tiny Llama built per test session, raw and loaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from engine.model import LoadedModel, load_model
from engine.tiny_model import build_tiny_model

# CI must be reproducible: property tests use a fixed example sequence there (and no example
# database); local runs keep exploring with fresh random examples.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still runs by default)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the deterministic tiny model (seed 0), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model loaded through `load_model` (float32, device auto)."""
    return load_model(str(tiny_model_dir))
