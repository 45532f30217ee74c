"""Readiness and graceful shutdown of a real server; 503 before the engine is loaded."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
from fastapi.testclient import TestClient

from tests.app.conftest import assert_error

SHUTDOWN_CONFIG = """
[model]
path = "tiny"

[server]
shutdown_timeout_s = 1
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
    # the long stream must outlast the shutdown timeout: 4,000 tokens (about what the tiny model's
    # 4,096 positions allow) took ~2 s on a Zen 5 VM, which once finished inside a 2 s timeout
    threads = [threading.Thread(target=_stream, args=(server.url, 10, short)),
               threading.Thread(target=_stream, args=(server.url, 4000, long))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    # both streams in flight before the signal (on a loaded machine the short one could still be
    # connecting when the long one has sent two events; a request that arrives after it is refused)
    while (len(long) < 2 or not short) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert short and len(long) >= 2, server.log()
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
    # the access log tells the cut stream from the finished one (both sent a 200 status line first)
    access = [line for line in server.log().splitlines() if "path=/v1/completions" in line]
    assert sorted(line.split("status=")[1].split()[0] for line in access) == ["200", "503"], access


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


DRAIN_CONFIG = """
[model]
path = "tiny"

[server]
shutdown_timeout_s = 120
"""
DRAIN_TOKENS = 2000


def _stream_safely(url: str, max_tokens: int, events: list) -> None:
    try:
        _stream(url, max_tokens, events)
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc!r}")


def _start_stream_and_sigterm(server) -> tuple[threading.Thread, list[str]]:
    """A long stream in flight (two events received), then SIGTERM to the server."""
    events: list[str] = []
    thread = threading.Thread(target=_stream_safely, args=(server.url, DRAIN_TOKENS, events))
    thread.start()
    deadline = time.monotonic() + 60
    while len(events) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(events) >= 2, server.log()
    server.proc.send_signal(signal.SIGTERM)
    return thread, events


def _ready_on_a_new_connection(url: str) -> httpx.Response:
    """Poll /ready, each time on a new connection, until the drain has begun (a bounded count)."""
    for _ in range(500):
        with httpx.Client(base_url=url, timeout=30) as fresh:
            response = fresh.get("/ready")
        if response.status_code == 503:
            return response
        time.sleep(0.01)
    raise AssertionError("/ready never answered 503 after SIGTERM")


def test_sigterm_keeps_answering_503_with_retry_after_while_the_stream_finishes(start_server) -> None:
    server = start_server(config=DRAIN_CONFIG)
    thread, events = _start_stream_and_sigterm(server)

    ready = _ready_on_a_new_connection(server.url)  # connection accepted: the listener is still open
    assert ready.json() == {"status": "draining"} and int(ready.headers["retry-after"]) >= 1
    with httpx.Client(base_url=server.url, timeout=30) as fresh:
        refused = fresh.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
    error = assert_error(refused, 503)
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    in_flight = len(events)
    assert in_flight < DRAIN_TOKENS and "[DONE]" not in events  # both answers came during the drain

    thread.join(120)
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0]["text"] or c["choices"][0]["finish_reason"]) >= 1
    assert server.proc.wait(60) == 0, server.log()
    log = server.log()
    assert "drain complete" in log and "shutdown complete" in log
    stream_lines = [line for line in log.splitlines() if "path=/v1/completions" in line]
    assert [line.split("status=")[1].split()[0] for line in stream_lines] == ["503", "200"], stream_lines


def test_second_sigterm_exits_at_once(start_server) -> None:
    server = start_server(config=DRAIN_CONFIG)
    engine_pid = httpx.get(server.url + "/admin/metrics", timeout=30).json()["engine"]["pid"]
    thread, events = _start_stream_and_sigterm(server)
    _ready_on_a_new_connection(server.url)  # the drain has begun
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 128 + signal.SIGTERM, server.log()
    thread.join(60)
    assert "[DONE]" not in events  # the stream was cut, not finished
    assert "exiting now without finishing the drain" in server.log()
    for _ in range(500):  # the engine process dies with the server (parent-death signal)
        if not os.path.exists(f"/proc/{engine_pid}") or _is_zombie(engine_pid):
            break
        time.sleep(0.02)
    else:
        os.kill(engine_pid, signal.SIGKILL)
        raise AssertionError(f"engine process {engine_pid} outlived the forced exit")


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_draining_answers_503_with_retry_after(kvgate_env) -> None:
    """While draining, /ready and the API say so with Retry-After (the longest drain, rounded up)."""
    from app.main import create_app
    from app.settings import load_settings

    app = create_app(load_settings(None, {"server.shutdown_timeout_s": 7.5}, env={}))
    app.state.draining = True
    client = TestClient(app)
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json() == {"status": "draining"}
    assert ready.headers["retry-after"] == "8"
    for response in (client.get("/v1/models"),
                     client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})):
        error = assert_error(response, 503)
        assert error["type"] == "service_unavailable" and response.headers["retry-after"] == "8"
    assert client.get("/health").status_code == 200
