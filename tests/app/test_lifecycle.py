"""Readiness and graceful shutdown of a real server; 503 before the engine is loaded."""

from __future__ import annotations

import json
import threading
import time

import httpx
from fastapi.testclient import TestClient

from tests.app.conftest import assert_error

SHUTDOWN_CONFIG = """
[model]
path = "tiny"

[server]
shutdown_timeout_s = 2
"""


def _stream(url: str, max_tokens: int, events: list) -> None:
    body = {"model": "tiny", "prompt": "once more", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])


def test_sigterm_finishes_short_streams_aborts_long_ones_and_exits_0(start_server) -> None:
    server = start_server(config=SHUTDOWN_CONFIG)
    short: list[str] = []
    long: list[str] = []
    threads = [threading.Thread(target=_stream, args=(server.url, 40, short)),
               threading.Thread(target=_stream, args=(server.url, 4000, long))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(long) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.monotonic()
    status = server.stop(timeout_s=30)
    for thread in threads:
        thread.join(10)
    assert status == 0, server.log()
    assert time.monotonic() - started < 15
    # the short stream finished normally
    assert short[-1] == "[DONE]"
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    # the long one was aborted after shutdown_timeout_s, with an error event and [DONE]
    assert long[-1] == "[DONE]"
    error = json.loads(long[-2])["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert "shutdown complete" in server.log()


def test_not_ready_until_the_engine_is_loaded(kvgate_env) -> None:
    """Before the lifespan has loaded a model, /health is up and everything else answers 503."""
    from app.main import create_app
    from app.settings import load_settings

    app = create_app(load_settings(env={}))
    client = TestClient(app)  # no `with`: the lifespan (and so the model load) never runs
    assert client.get("/health").status_code == 200
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json() == {"status": "loading"}
    assert_error(client.get("/v1/models"), 503)
    error = assert_error(client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}), 503)
    assert error["type"] == "service_unavailable"
