"""The Dockerfile and the compose file, checked without a Docker engine (none on these machines).

Statically: the Dockerfile is multi-stage on a slim Python base, installs with the README's own
command, prepares the default model at build time, runs as a non-root user with a HEALTHCHECK on
/health, an EXPOSEd port, the /data VOLUME and config from /config/kvgate.toml; only the apt-get
and useradd lines are left to Docker; the compose file is valid YAML (and passes `docker compose
config` where a Compose CLI is installed) with Redis (appendonly) and two replicas that share one
config, hence one remote URL and one secret. Then `.ci/dockerfile-steps`, which reads the
Dockerfile itself, runs its steps in a fresh virtualenv (a full `pip install -e .`, ~1 min) and
serves a completion from the result with a config file where the image's KVGATE_CONFIG points;
the test checks that every instruction of the Dockerfile was run or skipped as marked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from app.settings import load_settings
from tests.app.conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "loadtest" / "docker-compose.yml"
STEPS = ROOT / ".ci" / "dockerfile-steps"
CLUSTER_SCRIPT = ROOT / "loadtest" / "redis_cluster.sh"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, rest = (pending + stripped).partition(" ")
        out.append((keyword.upper(), " ".join(rest.split())))
        pending = ""
    return out


def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (from its FROM on)."""
    found: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, rest))
    return found


def normalized(instruction: str) -> str:
    return " ".join(instruction.split())


def marked() -> dict[str, str]:
    """Instruction (whitespace-normalized) -> its `# steps: X` marker, for the marked ones."""
    found: dict[str, str] = {}
    marker = ""
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        match = re.match(r"#\s*steps:\s*([a-z-]+)", stripped)
        if match and not pending:
            marker = match.group(1)
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        if marker:
            found[normalized(pending + stripped)] = marker
        pending = ""
        marker = ""
    return found


def readme_install_command() -> str:
    """The README's serve set-up without its last part (starting the server)."""
    readme = (ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if "pip install -e ." in line and "kvgate serve" in line)
    parts = [part.strip() for part in line.split("&&")]
    assert parts[-1].endswith("kvgate serve"), line
    return " && ".join(parts[:-1])


def test_dockerfile_is_multi_stage_on_a_slim_python_base_with_build_args() -> None:
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for kw, rest in instructions()[:2] if kw == "ARG"}
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    froms = [rest for kw, rest in instructions() if kw == "FROM"]
    assert len(froms) >= 2 and froms[0].startswith("${BASE_IMAGE}")
    assert "COPY --from=build /app /app" in [f"{kw} {rest}" for kw, rest in stages()[-1]]


def test_dockerfile_installs_with_the_readme_command_and_prepares_the_default_model() -> None:
    runs = [rest for kw, rest in instructions() if kw == "RUN"]
    command = readme_install_command()
    assert command == "python3 -m venv .venv && .venv/bin/pip install -e ."
    assert any(run.endswith(command) for run in runs), runs
    assert any("ensure_default_model()" in run for run in runs)
    text = DOCKERFILE.read_text()
    assert re.search(r"# steps: model\nRUN [^\n]*ensure_default_model\(\)", text), "mark the model step"
    build_env = " ".join(rest for kw, rest in stages()[1] if kw == "ENV")
    assert "PIP_EXTRA_INDEX_URL=${TORCH_INDEX}" in build_env


def test_dockerfile_runtime_is_non_root_with_healthcheck_port_volume_and_config() -> None:
    runtime = stages()[-1]
    kinds = {kw: rest for kw, rest in runtime}
    assert kinds["USER"] not in ("root", "0", "0:0") and not kinds["USER"].startswith("root")
    health = kinds["HEALTHCHECK"]
    exec_form = json.loads(health.split(" CMD ", 1)[1])
    assert exec_form[:2] == ["python3", "-c"] and "/health" in exec_form[2] and "curl" not in health
    assert kinds["EXPOSE"] == "8000"
    assert "/data" in json.loads(kinds["VOLUME"])
    env = " ".join(rest for kw, rest in runtime if kw == "ENV")
    assert "KVGATE_CONFIG=/config/kvgate.toml" in env and "KVGATE_CACHE_DIR=/data" in env
    assert json.loads(kinds["CMD"]) == ["kvgate", "serve", "--host", "0.0.0.0"]


def test_dockerignore_lets_exactly_the_copied_sources_through() -> None:
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    copied = set()
    for keyword, rest in instructions():
        if keyword == "COPY" and "--from=" not in rest:
            copied.update(rest.split()[:-1])
    assert copied == allowed
    assert all((ROOT / name).exists() for name in copied)


def test_compose_runs_redis_with_persistence_and_two_replicas_on_one_remote() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    replicas = {name: spec for name, spec in services.items() if name not in ("redis", "router")}
    assert sorted(replicas) == ["kvgate-a", "kvgate-b"]
    assert sorted(spec["ports"][0] for spec in replicas.values()) == ["8001:8000", "8002:8000"]
    configs = set()
    for spec in replicas.values():
        assert (COMPOSE.parent / spec["build"]["context"] / spec["build"]["dockerfile"]).resolve() == DOCKERFILE
        assert spec["depends_on"]["redis"]["condition"] == "service_healthy"
        mounts = {target: source for source, target, *_ in (volume.split(":") for volume in spec["volumes"])}
        configs.add(mounts["/config/kvgate.toml"])
        assert spec["environment"]["KVGATE_CONFIG"] == "/config/kvgate.toml"
    assert len(configs) == 1, "both replicas read one config: one remote URL, one set of tenants"
    data_volumes = [next(v for v in spec["volumes"] if v.endswith(":/data")) for spec in replicas.values()]
    assert len(set(data_volumes)) == 2, "each replica has its own disk tier"
    secrets = {spec["environment"]["KVGATE_SECRET"] for spec in replicas.values()}
    assert len(secrets) == 1, "one secret: tenant namespaces must agree across replicas"

    settings = load_settings(COMPOSE.parent / configs.pop(), env={"KVGATE_SECRET": "x" * 32})
    remote = settings.cache.remote
    assert remote is not None and remote.url.startswith("redis://redis:6379") and remote.write == "through"
    assert len(settings.tenants) == 2 and settings.admin.api_key
    assert settings.events.endpoint == "tcp://*:5557" and settings.events.replay_endpoint


def test_compose_puts_the_router_in_front_of_both_replicas() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    router = services["router"]
    command = router["command"]
    assert command[:2] == ["kvgate", "route"] and command[command.index("--port") + 1] == "8000"
    replicas = [command[i + 1] for i, arg in enumerate(command) if arg == "--replica"]
    assert replicas == ["http://kvgate-a:8000", "http://kvgate-b:8000"]
    assert router["ports"] == ["8000:8000"] and sorted(router["depends_on"]) == ["kvgate-a", "kvgate-b"]
    # the router derives tenants' salts as the replicas do: their config and their secret
    assert router["environment"]["KVGATE_SECRET"] == services["kvgate-a"]["environment"]["KVGATE_SECRET"]
    assert router["volumes"] == services["kvgate-a"]["volumes"][:1]
    from app.router.cli import add_parser, parse_replica

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(command[1:])  # the command line the router runs is one it accepts
    assert [parse_replica(r)[0] for r in args.replica] == replicas


@pytest.mark.parametrize("script", [STEPS, CLUSTER_SCRIPT], ids=lambda p: p.name)
def test_scripts_are_executable_and_answer_help(script: Path) -> None:
    assert os.access(script, os.X_OK)
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr
    bad = subprocess.run([str(script), "--no-such-option"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--help" in bad.stderr


def test_only_the_apt_and_useradd_steps_are_left_to_docker() -> None:
    """`.ci/dockerfile-steps` skips what is marked `# steps: docker-only`: nothing but installing
    python3 where the base lacks it and creating the user may be marked so, or the script would
    stop testing the image's real install; `# steps: model` marks only the default model. (The
    third: g++ for the native CPU kernels, which CI machines have.)"""
    marks = marked()
    docker_only = [instruction for instruction, mark in marks.items() if mark == "docker-only"]
    assert len(docker_only) == 3, docker_only
    assert docker_only[0].startswith("RUN if ! python3 -c") and "apt-get install" in docker_only[0]
    assert docker_only[1].startswith("RUN apt-get update") and "install -y --no-install-recommends g++" in docker_only[1]
    assert docker_only[2].startswith("RUN groupadd") and "useradd" in docker_only[2]
    assert all("pip install" not in instruction for instruction in docker_only)
    model = [instruction for instruction, mark in marks.items() if mark == "model"]
    assert model == ['RUN .venv/bin/python -c "from engine.default_model import ensure_default_model; '
                     'ensure_default_model()"']
    assert set(marks.values()) == {"docker-only", "model"}


def test_dockerfile_steps_lists_what_it_would_run() -> None:
    """`--list` shows every instruction of the Dockerfile, in order, with its marker."""
    result = subprocess.run([str(STEPS), "--list"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    listed = []
    for line in result.stdout.splitlines():
        mark, _, instruction = line.partition("] ")
        listed.append((mark.lstrip("["), normalized(instruction)))
    marks = marked()
    expected = [(marks.get(normalized(f"{kw} {rest}"), "-"), normalized(f"{kw} {rest}"))
                for kw, rest in instructions()]
    assert listed == expected
    assert any(mark == "-" and readme_install_command() in instruction for mark, instruction in listed)


def compose_cli() -> list[str] | None:
    """`docker compose` (v2 plugin) or `docker-compose` (v1), whichever works without a daemon."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_file_passes_the_compose_cli() -> None:
    """`docker compose config` validates the file against the Compose schema (no daemon needed)."""
    cli = compose_cli()
    if cli is None:
        pytest.skip("no Compose CLI: neither `docker compose` nor `docker-compose` (apt-get install docker-compose)")
    env = {k: v for k, v in os.environ.items() if k not in ("KVGATE_SECRET", "KVGATE_TORCH_INDEX")}
    result = subprocess.run([*cli, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=120,
                            env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    rendered = yaml.safe_load(result.stdout)["services"]
    assert set(rendered) == {"redis", "kvgate-a", "kvgate-b", "router"}
    for name in ("kvgate-a", "kvgate-b"):
        assert Path(rendered[name]["build"]["context"]).resolve() == ROOT
        assert rendered[name]["environment"]["KVGATE_SECRET"] == rendered["kvgate-a"]["environment"]["KVGATE_SECRET"]


def executed(output: str) -> list[tuple[str, str]]:
    """(instruction, what happened) for each instruction the script announced, in order."""
    lines = output.split("==> steps done in", 1)[0].splitlines()
    found = []
    for i, line in enumerate(lines):
        match = re.match(r"==> (?:\[[a-z]+\] )?([A-Z]+ .*)$", line)
        if not match or match.group(1).split(" ", 1)[0] not in KEYWORDS:
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        found.append((normalized(match.group(1)), following.strip() if following.startswith("    skipped") else "run"))
    return found


KEYWORDS = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "ADD", "RUN", "CMD", "HEALTHCHECK", "USER", "VOLUME",
            "EXPOSE", "STOPSIGNAL", "LABEL"}
METADATA = {"USER", "VOLUME", "EXPOSE", "STOPSIGNAL", "LABEL"}
MOUNTED = "[cache.device]\nnum_blocks = 200\n\n[cache.host]\ncapacity_mb = 8\n"


@pytest.mark.slow
def test_dockerfile_steps_give_a_working_server(tmp_path: Path) -> None:
    """Fresh venv, the README's install, the tiny model, a mounted config, HEALTHCHECK, one
    completion, disk tier and secret on the /data volume, SIGTERM → 0; every instruction of the
    Dockerfile was run except the marked ones.

    `TORCH_INDEX=` leaves pip's own index configuration in charge (CI has PyPI, not
    download.pytorch.org); the image's default-model step is skipped by `--model tiny`.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["TMPDIR"] = str(tmp_path)
    config = tmp_path / "mounted.toml"
    config.write_text(MOUNTED)
    command = [str(STEPS), "--model", "tiny", "--build-arg", "TORCH_INDEX=", "--config", str(config)]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:  # timed out: the script, its pip and its server are one process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-6000:]

    marks = marked()
    expected = []
    for keyword, rest in instructions():
        instruction = normalized(f"{keyword} {rest}")
        if marks.get(instruction) == "docker-only":
            expected.append((instruction, "skipped (docker-only)"))
        elif marks.get(instruction) == "model":
            expected.append((instruction, "skipped (--model tiny)"))
        elif keyword in METADATA:
            expected.append((instruction, "skipped (image metadata)"))
        else:
            expected.append((instruction, "run"))
    assert executed(output) == expected, output[-6000:]

    root = re.search(r"==> image file system in (\S+) ", output).group(1)
    assert f"config {config} mounted at {root}/config/kvgate.toml" in output
    assert "HEALTHCHECK passed" in output and "completion from tiny" in output
    volume = re.search(r"    volume (\S+): disk tier in (\S+); (\d+) device blocks; tiers (.*)$", output, re.M)
    assert volume, output[-3000:]
    assert volume.group(1) == f"{root}/data" and volume.group(2).startswith(f"{root}/data/kv/")
    assert volume.group(3) == "200", "the mounted config (num_blocks = 200) was not read through KVGATE_CONFIG"
    assert {"host", "disk"} <= set(volume.group(4).split(", "))
    assert "OK: the Dockerfile's steps give a working server" in output
    assert not list(tmp_path.glob("kvgate-dockerfile-steps.*")), "the script removes its folder"
