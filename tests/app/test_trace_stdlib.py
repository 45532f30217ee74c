"""`kvgate trace` with the base install only: no httpx (a dev extra), only the standard library.

Each CLI run here is a subprocess in which `import httpx` fails, against a small stand-in server
(the standard library's http.server) that speaks the three endpoints the CLI uses and drops every
keep-alive connection after one reply, as a server does with idle ones.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.app.conftest import ROOT

TRACE = [{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [0, 1]},
         {"timestamp": 5, "input_length": 20, "output_length": 2, "hash_ids": [0, 2]},
         {"timestamp": 9, "input_length": 12, "output_length": 2, "hash_ids": [3]}]
_WITHOUT_HTTPX = "import sys; sys.modules['httpx'] = None; from app.cli import main; sys.exit(main(sys.argv[1:]))"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict] = []

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True  # without saying so: the client must reconnect by itself

    def do_GET(self) -> None:
        if self.path.startswith("/admin/trace"):
            if self.headers.get("Authorization") != "Bearer admin-key":
                self._send(401, b'{"error": {"message": "missing key"}}', "application/json")
                return
            lines = "".join(json.dumps(line) + "\n" for line in TRACE).encode()
            self._send(200, lines, "application/x-ndjson", {"X-KVGate-Block-Tokens": "16"})
        elif self.path == "/v1/models":
            self._send(200, b'{"data": [{"id": "stand-in", "max_model_len": 64}]}', "application/json")
        else:
            self._send(404, b'{"error": {"message": "not found"}}', "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.seen.append(body)
        cached = 10 if len(_Handler.seen) > 1 and body["prompt"][:10] == _Handler.seen[0]["prompt"][:10] else 0
        events = [{"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]},
                  {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                            "prompt_tokens_details": {"cached_tokens": cached}}}]
        stream = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
        self._send(200, stream.encode(), "text/event-stream")


@pytest.fixture()
def stand_in() -> Iterator[str]:
    _Handler.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _WITHOUT_HTTPX, "trace", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_export_and_replay_work_without_httpx(stand_in: str, tmp_path: Path) -> None:
    out = tmp_path / "trace.jsonl"
    denied = _kvgate("export", "--url", stand_in, "--out", str(out))
    assert denied.returncode == 1 and "wants an API key (missing key)" in denied.stderr, denied.stderr
    exported = _kvgate("export", "--url", stand_in + "/v1", "--api-key", "admin-key", "--out", str(out),
                       "--block-tokens", "16")
    assert exported.returncode == 0, exported.stderr
    assert "wrote 3 requests" in exported.stderr and "--block-tokens 16" in exported.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == TRACE

    replayed = _kvgate("replay", str(out), "--url", stand_in, "--block-tokens", "10", "--speed", "0",
                       "--concurrency", "1", "--json")
    assert replayed.returncode == 0, replayed.stderr
    summary = json.loads(replayed.stdout)
    assert summary["requests"] == 3 and summary["failures"] == 0, summary
    assert summary["prompt_tokens"] == 52 and summary["cached_tokens"] == 10  # the second shares block 0
    assert summary["ttft_s"]["p50"] is not None
    assert [len(body["prompt"]) for body in _Handler.seen] == [20, 20, 12]
    assert all(body["model"] == "stand-in" and body["stream"] for body in _Handler.seen)


def test_unreachable_server_without_httpx_is_one_line(tmp_path: Path) -> None:
    result = _kvgate("export", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "t.jsonl"))
    assert result.returncode == 1 and "cannot reach the server at http://127.0.0.1:9" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_trace_cli_imports_only_the_standard_library_and_kvgate() -> None:
    """What `kvgate trace` imports at the top of its modules is there after `pip install -e .`."""
    for name in ("app/trace_cli.py", "app/trace.py"):
        tree = ast.parse((ROOT / name).read_text())
        modules = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import)
                   for alias in node.names}
        modules |= {node.module.split(".")[0] for node in tree.body
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
        outside = {m for m in modules if m not in sys.stdlib_module_names and m not in ("app", "engine", "cache")}
        assert not outside, f"{name} imports {outside}, which the base install may lack"
