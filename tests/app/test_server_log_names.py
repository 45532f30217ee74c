"""Every line `kvgate serve` logs comes from a KVGate logger (`kvgate.*` or a module of the
project), none from `uvicorn.error`, and a start at INFO says nothing before the server is ready
that reads as if it were."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.app.conftest import ROOT

_EMIT = """
import logging, sys
from app.logging import configure_logging
configure_logging(sys.argv[1])
configure_logging(sys.argv[1])  # twice, as the engine process's initializer may: one filter
server = logging.getLogger("uvicorn.error")
server.info("Application startup complete.")
server.warning("Invalid HTTP request received.")
"""
_LINE = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): ", re.M)


def _emit(level: str) -> str:
    result = subprocess.run([sys.executable, "-c", _EMIT, level], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_uvicorn_lines_are_kvgate_server_lines_and_routine_ones_are_debug() -> None:
    info = _emit("info")
    assert "uvicorn" not in info and "Application startup complete" not in info, info
    assert info.count("WARNING kvgate.server: Invalid HTTP request received.") == 1, info
    debug = _emit("debug")
    assert debug.count("DEBUG kvgate.server: Application startup complete.") == 1, debug
    assert "uvicorn" not in debug


def test_a_server_start_logs_only_from_kvgate_loggers(start_server) -> None:
    server = start_server("--model", "tiny")
    server.stop()  # the drain and shutdown lines too
    log = server.log()
    names = {name for _, name in _LINE.findall(log)}
    assert names, log
    assert all(name.split(".")[0] in ("kvgate", "app", "engine", "cache", "tenants") for name in names), names
    assert "uvicorn" not in log and "oneDNN" not in log, log
