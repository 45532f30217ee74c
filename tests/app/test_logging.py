"""Access log and progress output: bounded counters, quiet health polls, one line per event."""

from __future__ import annotations

import logging
import random
import string
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import load_settings
from tests.app.conftest import ROOT


@pytest.fixture()
def client() -> TestClient:
    return TestClient(create_app(load_settings(None, env={})))  # no lifespan: no model needed


def _by_path(client: TestClient) -> dict[str, int]:
    return client.get("/admin/metrics").json()["requests"]["by_path"]


def test_by_path_is_keyed_by_route_template_and_stays_bounded(client: TestClient) -> None:
    rng = random.Random(17)

    def random_path() -> str:
        return "/" + "/".join("".join(rng.choices(string.ascii_letters, k=rng.randint(1, 12)))
                              for _ in range(rng.randint(1, 4)))

    client.get(random_path())
    client.get("/health")
    client.get("/v1/models/some-model")  # 503 (no engine), but routed
    before = _by_path(client)
    for _ in range(1000):
        assert client.get(random_path()).status_code == 404
    after = _by_path(client)
    assert len(after) == len(before) + 1  # + "/admin/metrics", which the first snapshot did not count yet
    assert after["unmatched"] == 1001
    assert after["/v1/models/{model_id:path}"] == 1 and after["/health"] == 1
    assert not [key for key in after if key.startswith("/") and "{" not in key
                and key not in ("/health", "/admin/metrics")]


def test_health_and_ready_polls_are_debug_other_requests_info(client: TestClient,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvgate.access"):
        client.get("/health")
        client.get("/ready")
        client.get("/no/such/page")
    access = [r for r in caplog.records if r.name == "kvgate.access"]
    assert [(r.levelno, r.access["path"]) for r in access] == [  # type: ignore[attr-defined]
        (logging.DEBUG, "/health"), (logging.DEBUG, "/ready"), (logging.INFO, "/no/such/page")]
    assert not [r for r in access if r.levelno >= logging.INFO and r.access["path"] == "/health"]  # type: ignore[attr-defined]


_BUILD_LOGGED = """
from app.logging import configure_logging
configure_logging("info")
from engine.tiny_model import tiny_model_dir
tiny_model_dir()
"""


def _lines(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def test_progress_is_one_line_per_event_when_logging_is_configured(tmp_path: Path) -> None:
    env = {"KVGATE_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", _BUILD_LOGGED], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert len(_lines(output, "building tiny Llama")) == 1, output
    assert len(_lines(output, "built tiny model")) == 1, output
    assert "INFO engine.tiny_model: building tiny Llama" in output  # through logging, with a level
    assert "it/s" not in output and "\r" not in output, output  # no progress bar into a log file


def test_build_tiny_model_prints_one_line_per_event_without_bars(tmp_path: Path) -> None:
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    env = {"KVGATE_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([kvgate, "build-tiny-model", str(tmp_path / "tiny")], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert _lines(result.stderr, "building tiny Llama") == [f"kvgate: building tiny Llama (seed 0) in "
                                                            f"{tmp_path / 'tiny'}"]
    assert len(_lines(result.stderr, "built tiny model")) == 1
    assert "it/s" not in result.stderr and "\r" not in result.stderr, result.stderr
