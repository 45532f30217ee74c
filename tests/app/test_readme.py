"""The README's curl and `openai` SDK examples run verbatim against a real server.

Runs every fenced block whose info string has a `title="..."` (```bash title="curl-chat"), from
README.md, or from docs/usage.md while the README does not carry them yet. The only changes are
the address (`localhost:8000` → the test server) and the default model's name (→ `tiny`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from tests.app.conftest import ROOT

_BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)
_TITLE = re.compile(r'title="([^"]+)"')


def _examples() -> list[tuple[str, str, str]]:
    for name in ("README.md", "docs/usage.md"):
        path = ROOT / name
        if not path.exists():
            continue
        found = [(m2.group(1), lang, code) for lang, info, code in _BLOCK.findall(path.read_text())
                 if (m2 := _TITLE.search(info)) and lang in ("bash", "python")]
        if found:
            return found
    return []


EXAMPLES = _examples()


def test_examples_exist() -> None:
    titles = {title for title, _, _ in EXAMPLES}
    assert any(t.startswith("curl") for t in titles) and any(t.startswith("openai") for t in titles)


@pytest.mark.parametrize(("title", "lang", "code"), EXAMPLES, ids=[t for t, _, _ in EXAMPLES])
def test_example_runs(server, kvgate_env, title: str, lang: str, code: str) -> None:
    code = code.replace("localhost:8000", f"127.0.0.1:{server.port}").replace("SmolLM2-135M-Instruct", "tiny")
    if lang == "bash":
        if shutil.which("curl") is None:
            pytest.skip("curl is not installed")
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        command = [sys.executable, "-c", code]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=kvgate_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), f"{title} printed nothing"
    assert '"error"' not in result.stdout, result.stdout
    if "stream" in title:
        assert result.stdout.rstrip().endswith("data: [DONE]")


_DOCS = ("README.md", "bench/README.md", "docs/CONTRACT.md", "docs/server.md", "docs/serving.md")
_REPO_PATH = re.compile(r"(?<!> )(?<![\w./])((?:docs|bench|tests|app|engine|cache|tenants)/[\w./-]+\.(?:md|py|json|png|toml))")


@pytest.mark.parametrize("name", _DOCS)
def test_docs_name_only_files_that_exist(name: str) -> None:
    """Every repository file a document points at exists (output targets after `>` aside)."""
    text = (ROOT / name).read_text()
    missing = sorted({path for path in _REPO_PATH.findall(text) if not (ROOT / path).exists()})
    assert not missing, f"{name} names files that are not in the repository: {missing}"
    for stale in ("DESIGN.md", "shared/CONTRACT.md"):
        assert stale not in text, f"{name} points at {stale}, which is not in this repository"


def test_readme_has_exactly_two_setup_commands() -> None:
    """A fresh machine needs one command to serve and one to test, nothing else."""
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = [code for lang, _, code in _BLOCK.findall(setup) if lang == "bash"]
    assert len(commands) == 2 and all(code.strip().startswith("python3 -m venv .venv") for code in commands)
    assert "kvgate serve" in commands[0] and "pytest" in commands[1]


def test_contract_lists_planned_features_in_one_place() -> None:
    text = (ROOT / "docs/CONTRACT.md").read_text()
    planned = text.split("## Planned", 1)
    assert len(planned) == 2
    for feature in ("MAC'd",):
        assert feature not in planned[0].replace("/admin/metrics", ""), f"{feature} is promised outside Planned"
        assert feature in planned[1]
    for built in ("GET /metrics", "GET /admin/archetype", "GET /admin/trace", "kvgate trace replay", "Dockerfile",
                  "GET /admin`"):  # once built, described above and gone from Planned
        assert built in planned[0] and built not in planned[1], built


def test_ci_runs_the_readme_test_command() -> None:
    """`.ci/run` runs every step of the README's test command, in order and ending with pytest
    (it may add steps, such as ruff and mypy before pytest; docs/testing.md)."""
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    readme = [code for lang, _, code in _BLOCK.findall(setup) if lang == "bash"][1].strip()
    ci = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv"))
    readme_steps, ci_steps = [s.strip() for s in readme.split("&&")], [s.strip() for s in ci.split("&&")]
    remaining = iter(ci_steps)
    assert all(step in remaining for step in readme_steps), (readme, ci)  # a subsequence, in order
    assert ci_steps[-1] == readme_steps[-1] and "pytest" in ci_steps[-1]
