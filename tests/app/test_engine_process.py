"""The engine runs in its own process: one thread steps it, a crash is a 503 and a restart, no orphans."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

ENGINE_CONFIG = """
[model]
path = "tiny"

[server]
shutdown_timeout_s = 2
"""


def _engine(server) -> dict:
    return httpx.get(server.url + "/admin/metrics", timeout=30).json()


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_engine_process_is_a_child_stepping_on_the_thread_that_loaded_it(server) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    metrics = _engine(server)
    pid = metrics["engine_pid"]
    assert metrics["engine"]["mode"] == "process" and metrics["engine"]["pid"] == pid
    assert pid != server.proc.pid
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert ppid == server.proc.pid
    threads = metrics["engine_threads"]
    assert threads["step"] == threads["owner"]
    # the KV pool and weights on transparent huge pages, where the kernel lets a process ask
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"THP_MEM_ALLOC_ENABLE=1" in environ
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        huge_kb = int(next(line for line in rollup.splitlines() if line.startswith("AnonHugePages:")).split()[1])
        assert huge_kb >= 2048, rollup


def _stream(url: str, events: list[str]) -> None:
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])


def test_kill_9_of_the_engine_fails_the_stream_with_503_and_the_engine_restarts(start_server) -> None:
    server = start_server(config=ENGINE_CONFIG)
    old_pid = _engine(server)["engine_pid"]
    events: list[str] = []
    reader = threading.Thread(target=_stream, args=(server.url, events))
    reader.start()
    deadline = time.monotonic() + 30
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(old_pid, signal.SIGKILL)
    reader.join(30)
    assert not reader.is_alive(), "the stream hung after the engine died"
    # an error event in the OpenAI shape, then [DONE]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and "engine process stopped" in error["message"]
    # restarting: /ready says so (a restart loads torch and the model: seconds), then serves again
    ready = httpx.get(server.url + "/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["status"] == "restarting", ready.text
    refused = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    server.wait_until("/ready", timeout_s=120)
    body = {"model": "tiny", "prompt": "after the restart", "max_tokens": 4, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    metrics = _engine(server)
    assert metrics["engine"]["restarts"] == 1 and metrics["engine_pid"] != old_pid
    assert "engine process stopped unexpectedly (killed by signal 9)" in server.log()
    new_pid = metrics["engine_pid"]
    assert server.stop() == 0
    assert _wait_gone(new_pid), "the engine process outlived a SIGTERM'd server"


def test_kill_9_of_the_server_takes_the_engine_process_with_it(start_server) -> None:
    server = start_server(config=ENGINE_CONFIG)
    pid = _engine(server)["engine_pid"]
    server.proc.kill()
    server.proc.wait(10)
    assert _wait_gone(pid), "orphaned engine process after kill -9 of the server"
    server.stop()
