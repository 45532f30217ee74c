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
