"""The `kvgate` console script: help, config errors, build-tiny-model."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.app.conftest import KVGATE


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVGATE, *args], capture_output=True, text=True, timeout=120, env=env)


def test_help_lists_commands_and_flags() -> None:
    top = _run("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "build-tiny-model" in top.stdout
    serve = _run("serve", "--help")
    for flag in ("--config", "--model", "--host", "--port", "KVGATE_CONFIG", "KVGATE_CACHE_DIR"):
        assert flag in serve.stdout
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


def test_serve_exits_1_when_the_model_cannot_load(kvgate_env: dict[str, str]) -> None:
    from tests.app.conftest import free_port

    result = _run("serve", "--model", "/does/not/exist", "--port", str(free_port()), env=kvgate_env)
    assert result.returncode == 1
    assert "model failed to load" in result.stderr
