"""The `kvgate` console script: help, config errors, build-tiny-model, and fast start-up failures.

Failures that can be seen before anything slow starts (address in use, model not found) are one
`kvgate: error:` line and status 2; the tests check the output, not the wall time.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

from app import cli
from tests.app.conftest import KVGATE, ROOT, free_port


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVGATE, *args], capture_output=True, text=True, timeout=120, env=env)


def test_help_lists_commands_and_flags() -> None:
    top = _run("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "build-tiny-model" in top.stdout
    serve = _run("serve", "--help")
    for flag in ("--config", "--model", "--host", "--port", "KVGATE_CONFIG", "KVGATE_CACHE_DIR",
                 "max_fanout", "docs (public|auth|off", "exit status", "second one exits at once",
                 "THP_MEM_ALLOC_ENABLE"):
        assert flag in serve.stdout, flag
    tiny = _run("build-tiny-model", "--help")
    assert all(flag in tiny.stdout for flag in ("DIR", "--seed", "--size"))
    assert _run().returncode == 2


def test_serve_rejects_unknown_config_key(tmp_path: Path, kvgate_env: dict[str, str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nprot = 8000\n")
    result = _run("serve", "--config", str(config), env=kvgate_env)
    assert result.returncode == 2
    assert "unknown key 'server.prot'" in result.stderr
    result = _run("serve", env={**kvgate_env, "KVGATE_CONFIG": str(config)})
    assert result.returncode == 2 and "server.prot" in result.stderr


def test_build_tiny_model(tmp_path: Path, kvgate_env: dict[str, str]) -> None:
    out = tmp_path / "tiny"
    result = _run("build-tiny-model", str(out), "--seed", "3", env=kvgate_env)
    assert result.returncode == 0, result.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).chat_template
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "llama"


def test_build_tiny_model_files_follow_the_umask(tmp_path: Path, kvgate_env: dict[str, str]) -> None:
    """model.safetensors (written by save_pretrained via a private temp file) gets the same mode as the rest."""
    out = tmp_path / "tiny"
    result = subprocess.run(["bash", "-c", f"umask 027 && exec {KVGATE} build-tiny-model {out}"],
                            capture_output=True, text=True, timeout=120, env=kvgate_env)
    assert result.returncode == 0, result.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o640 and set(modes.values()) == {0o640}, modes


def _one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The failure is one `kvgate: error:` line naming the problem, before anything was started."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if " INFO " not in line]  # e.g. secret made
    assert len(lines) == 1 and lines[0].startswith("kvgate: error: "), result.stderr
    assert "Traceback" not in result.stderr and "loading model" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_serve_fails_at_once_when_the_port_is_taken(kvgate_env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = _run("serve", "--model", "tiny", "--port", str(port), env=kvgate_env)
    _one_line_error(result, f"127.0.0.1:{port}", "already in use", "--port", "stop the process")


def test_serve_fails_at_once_for_a_missing_model_folder(kvgate_env: dict[str, str]) -> None:
    for model in ("/nonexistent/path", "./no/such/model", "~/no-such-kvgate-model"):
        result = _run("serve", "--model", model, "--port", str(free_port()), env=kvgate_env)
        _one_line_error(result, f"model folder {model} not found", "'tiny'")


def test_serve_fails_at_once_for_a_folder_without_config(tmp_path: Path, kvgate_env: dict[str, str]) -> None:
    result = _run("serve", "--model", str(tmp_path), "--port", str(free_port()), env=kvgate_env)
    _one_line_error(result, "has no config.json")


def test_serve_fails_at_once_for_a_hub_id_offline(tmp_path: Path, kvgate_env: dict[str, str]) -> None:
    env = {**kvgate_env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = _run("serve", "--model", "no-such-org/no-such-model", "--port", str(free_port()), env=env)
    _one_line_error(result, "'no-such-org/no-such-model'", "HF_HUB_OFFLINE=1", "hf download")


def test_serve_fails_at_once_for_a_hub_id_when_the_hub_is_unreachable(tmp_path: Path,
                                                                        kvgate_env: dict[str, str]) -> None:
    """No retries: one refused connection (a closed local port stands in for the hub) is enough."""
    env = {**kvgate_env, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HUB_CACHE": str(tmp_path / "hub")}
    env.pop("HF_HUB_OFFLINE", None)
    result = _run("serve", "--model", "no-such-org/no-such-model", "--port", str(free_port()), env=env)
    _one_line_error(result, "cannot reach", "not in the local Hugging Face cache", "'tiny'")


def test_cached_hub_model_is_served_offline_when_the_hub_is_unreachable(tmp_path: Path) -> None:
    """A model in the HF cache needs no hub: the check passes and turns offline mode on for loading."""
    hub = tmp_path / "hub"
    snapshot = hub / "models--some-org--cached-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (hub / "models--some-org--cached-model" / "refs").mkdir()
    (hub / "models--some-org--cached-model" / "refs" / "main").write_text("0" * 40)
    code = ("import os; from engine.model_source import check_model_source; "
            "print(check_model_source('some-org/cached-model')); print(os.environ.get('HF_HUB_OFFLINE'))")
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_CACHE": str(hub), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    note, offline = result.stdout.strip().splitlines()
    assert "unreachable" in note and "cached copy" in note and offline == "1"


def test_serve_exits_1_with_one_line_when_the_model_cannot_load(tmp_path: Path,
                                                                 kvgate_env: dict[str, str]) -> None:
    """A folder that passes the early check but fails in the engine: status 1, a message, no traceback."""
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}')
    result = _run("serve", "--model", str(tmp_path), "--port", str(free_port()), env=kvgate_env)
    assert result.returncode == 1, result.stderr
    failures = [line for line in result.stderr.splitlines() if "model failed to load" in line]
    assert len(failures) == 1 and "model_type 'gpt2'" in failures[0], result.stderr
    assert "Traceback" not in result.stderr


def test_huge_pages_are_asked_for_unless_the_user_chose(monkeypatch) -> None:
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert cli.main([]) == 2  # no subcommand: help, after the variable is set
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    cli.main([])
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
