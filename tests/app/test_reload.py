"""Reloading the tenants while serving (SIGHUP or POST /admin/reload): a removed key stops
working at once, a new one works, a request already running finishes, a broken file changes
nothing."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx

from tests.app.conftest import assert_error


def config(keys_a: list[str], admin: str = "admin-reload") -> str:
    return f"""
[model]
path = "tiny"

[admin]
api_key = "{admin}"

[[tenants]]
name = "a"
api_keys = {keys_a!r}

[[tenants]]
name = "b"
api_keys = ["sk-b-reload"]
""".replace("'", '"')


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def status(client: httpx.Client, key: str) -> int:
    return client.get("/v1/models", headers=bearer(key)).status_code


def config_path(server) -> Path:
    args = server.proc.args
    return Path(args[args.index("--config") + 1])


def test_a_removed_key_stops_at_once_and_running_requests_finish(start_server) -> None:
    server = start_server(config=config(["sk-a-old"]))
    path = config_path(server)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert status(client, "sk-a-old") == 200 and status(client, "sk-a-new") == 401
        result: dict[str, object] = {}

        def long_request() -> None:  # a stream that runs across the reload
            body = {"model": "tiny", "prompt": "tell me a story", "max_tokens": 300, "ignore_eos": True,
                    "stream": True}
            with client.stream("POST", "/v1/completions", json=body, headers=bearer("sk-a-old")) as response:
                lines = [line for line in response.iter_lines() if line]
            result["status"], result["last"] = response.status_code, lines[-1]

        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(0.3)
        path.write_text(config(["sk-a-new"]))
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while status(client, "sk-a-old") != 401 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status(client, "sk-a-old") == 401 and status(client, "sk-a-new") == 200
        assert status(client, "sk-b-reload") == 200  # the others are untouched
        worker.join(60)
        assert result == {"status": 200, "last": "data: [DONE]"}
        assert "sk-a-new" not in server.log() and "tenants reloaded: 2 tenant(s)" in server.log()


def test_the_admin_call_reloads_and_a_broken_file_changes_nothing(start_server) -> None:
    server = start_server(config=config(["sk-a-1"]))
    path = config_path(server)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert_error(client.post("/admin/reload", headers=bearer("sk-a-1")), 401)
        path.write_text(config(["sk-a-1", "sk-a-2"], admin="admin-reload-2"))
        answer = client.post("/admin/reload", headers=bearer("admin-reload"))
        assert answer.json() == {"tenants": ["a", "b"], "admin_key": True}
        assert status(client, "sk-a-2") == 200
        assert_error(client.post("/admin/reload", headers=bearer("admin-reload")), 401)  # the admin key changed too
        path.write_text("[[tenants]]\nname = 'broken'\n")  # no api_keys
        error = assert_error(client.post("/admin/reload", headers=bearer("admin-reload-2")), 400)
        assert "unchanged" in error["message"]
        assert status(client, "sk-a-2") == 200 and status(client, "sk-b-reload") == 200
        server.proc.send_signal(signal.SIGHUP)  # the same broken file through the signal: logged, no harm
        time.sleep(0.5)
        assert server.proc.poll() is None and status(client, "sk-a-1") == 200
        assert "SIGHUP: reload failed" in server.log()
