"""`loadtest/summary.py snapshot` against a server without `/admin/metrics` (`kvgate route`, another
OpenAI server): the run goes on without per-tier figures instead of stopping run.sh."""

from __future__ import annotations

import importlib.util
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.app.conftest import ROOT

pytestmark = pytest.mark.unit


def _summary():  # loadtest/ is not a package: load the script as run.sh runs it
    spec = importlib.util.spec_from_file_location("loadtest_summary", ROOT / "loadtest" / "summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Answers(BaseHTTPRequestHandler):
    status = 404

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": {"message": "no"}}' if self.status != 200 else b'{"num_blocks": 1}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("status, written", [(404, False), (200, True)])
def test_a_server_without_admin_metrics_is_skipped_not_fatal(tmp_path: Path, status: int, written: bool) -> None:
    handler = type("Handler", (_Answers,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out = tmp_path / "metrics.json"
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert _summary().main(["snapshot", url, str(out)]) in (0, None)
        assert out.exists() == written
    finally:
        server.shutdown()
        server.server_close()
