"""CI-sized load test: `loadtest/run.sh` starts a real `kvgate serve` (tiny model, two tenants, an
admin key) and runs the locust workloads of `loadtest/locustfile.py` headless against it.

One bounded run, 4 users (one per workload, the two tenants' keys in turn) for 12 s: no request
may fail; the shared-prefix workloads (one system prompt, a few hot documents) must get more than
half of their prompt tokens from the cache (`usage.prompt_tokens_details.cached_tokens`, summed by
the locustfile), conversations must reuse their history, and the unique-prompt control must get
(almost) none; the server's own `/admin/metrics` (saved by run.sh) must agree and show both
tenants. The run must leave locust's CSV with a TTFT row per workload, the summary (req/s,
failures, TTFT p50/p95, per-tier hit rates) and its plot, and stop its server. There are no timing
assertions: the machine may be slow; only counts of tokens and requests are checked. The
`--kv-*` options locust shows must be those loadtest/README.md lists, and run.sh's `--help` must
describe every option it parses. Every server is stopped and every folder removed.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.app.conftest import ROOT

pytestmark = pytest.mark.slow

LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
RUN_SH = ROOT / "loadtest" / "run.sh"
README = ROOT / "loadtest" / "README.md"
ADMIN_KEY = "loadtest-tests-admin"
KEYS = {"a": "sk-loadtest-a", "b": "sk-loadtest-b"}
CONFIG = f"""
[model]
path = "tiny"

[admin]
api_key = "{ADMIN_KEY}"

[[tenants]]
name = "a"
api_keys = ["{KEYS['a']}"]

[[tenants]]
name = "b"
api_keys = ["{KEYS['b']}"]
"""
# Short texts and replies, little think time: many requests per user even on a slow machine.
WORKLOAD_ENV = {"KVGATE_SYSTEM_WORDS": "200", "KVGATE_DOC_WORDS": "300", "KVGATE_DOCS": "2",
                "KVGATE_UNIQUE_WORDS": "200", "KVGATE_TURN_WORDS": "30", "KVGATE_MAX_TOKENS": "4",
                "KVGATE_WAIT_S": "0.1"}
WORKLOADS = ("shared-system", "multi-turn", "document-qa", "unique")


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    """One temporary folder for this module (cache dir, config, outputs); removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="kvgate-loadtest-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def env(folder: Path) -> dict[str, str]:
    """Environment of run.sh (server and locust): a private cache dir, nothing of the caller's
    KVGate or locust settings."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "LOCUST_"))}
    return {**base, "KVGATE_CACHE_DIR": str(folder / "cache"), "OMP_NUM_THREADS": "1",
            "PYTHON": sys.executable, **WORKLOAD_ENV}


def read_stats(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    with path.open(newline="") as handle:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(handle)}


def test_a_bounded_run_reuses_prefixes_fails_nothing_and_leaves_its_summary(env: dict[str, str],
                                                                            folder: Path) -> None:
    config = folder / "kvgate.toml"
    config.write_text(CONFIG)
    out = folder / "run"
    command = ["bash", str(RUN_SH), "--config", str(config), "--users", "4", "--spawn-rate", "4",
               "--run-time", "12s", "--out", str(out), "--label", "ci", "--quiet", "--ready-timeout", "180"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output

    for name in ("locust_stats.csv", "locust.html", "workloads.json", "metrics_before.json",
                 "metrics_after.json", "summary.md", "summary.json", "server.log", "run.json"):
        assert (out / name).is_file(), f"{name} missing\n{output}"
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # locust's own statistics: nothing failed, every request also has its TTFT row
    stats = read_stats(out / "locust_stats.csv")
    assert all(row["Failure Count"] == "0" for row in stats.values()), output
    report = json.loads((out / "workloads.json").read_text())["workloads"]
    for name in WORKLOADS:
        requests = int(stats[("POST", name)]["Request Count"])
        assert requests >= 4, f"{name}: only {requests} requests in 12 s, too few to judge\n{output}"
        assert int(stats[("TTFT", name)]["Request Count"]) == requests == report[name]["requests"]

    # the cache, as the clients saw it (usage.prompt_tokens_details.cached_tokens)
    rates = {name: report[name]["hit_rate"] for name in WORKLOADS}
    assert rates["shared-system"] > 0.5, (rates, output)
    assert rates["document-qa"] > 0.5, (rates, output)
    assert report["multi-turn"]["cached_tokens"] > 0, (rates, output)  # later turns reuse earlier ones
    assert rates["unique"] < 0.05, (rates, output)

    # ... and as the server counted it; both tenants sent requests with their own keys
    after = json.loads((out / "metrics_after.json").read_text())
    client_cached = sum(report[name]["cached_tokens"] for name in WORKLOADS)
    assert after["requests"]["cached_tokens_total"] >= client_cached > 0
    tenants = after["requests"]["tenants"]
    assert {"a", "b"} <= set(tenants) and all(tenants[t]["requests"] > 0 for t in ("a", "b")), tenants

    # the summary: req/s, failures, TTFT percentiles per workload, hit rate per tier
    summary = json.loads((out / "summary.json").read_text())
    assert summary["label"] == "ci"
    assert summary["failures"] == 0 and summary["requests"] == sum(r["requests"] for r in report.values())
    assert summary["requests_per_s"] > 0
    assert set(summary["workloads"]) == set(WORKLOADS)
    for name in WORKLOADS:
        row = summary["workloads"][name]
        assert row["ttft_p50_ms"] is not None and row["ttft_p95_ms"] >= row["ttft_p50_ms"], row
        assert row["hit_rate"] == rates[name]
    assert {"device", "host", "disk"} <= set(summary["tiers"])  # the admin key reached /admin/metrics
    assert summary["tiers"]["device"]["hits"] > 0
    table = (out / "summary.md").read_text()
    assert "| shared-system |" in table and "| device (tokens) |" in table
    assert "| shared-system |" in done.stdout

    # the server is gone, after a clean drain
    url = json.loads((out / "run.json").read_text())["url"]
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    assert "shutdown complete" in (out / "server.log").read_text()


def test_the_locustfile_options_are_those_the_readme_lists(env: dict[str, str]) -> None:
    """`python loadtest/locustfile.py` prints the --kv-* options (locust's --help cannot): the same
    flags, variables and numeric defaults as loadtest/README.md's table."""
    shown = subprocess.run([sys.executable, str(LOCUSTFILE)], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    options = dict(re.findall(r" (--kv-[a-z-]+) [A-Z_]+ .*?\(env (KVGATE_[A-Z_]+); default", text))
    defaults = dict(re.findall(r"\(env (KVGATE_[A-Z_]+); default ([^)]*)\)", text))
    rows = re.findall(r"^\| `(--kv-[a-z-]+)` \| `(KVGATE_[A-Z_]+)` \| ([^|]+) \|", README.read_text(), re.M)
    assert options == {flag: variable for flag, variable, _ in rows}
    for _, variable, default in rows:
        if re.fullmatch(r"[0-9.]+", default.strip()):
            assert float(defaults[variable]) == float(default), (variable, defaults[variable], default)


def test_run_sh_help_describes_every_option() -> None:
    script = RUN_SH.read_text()
    options = set(re.findall(r"^\s+(?:-h\|)?(--[a-z-]+)(?:\|--[a-z-]+)?\)", script, re.M))
    options |= set(re.findall(r"^\s+--[a-z-]+\|(--[a-z-]+)\)", script, re.M))
    assert len(options) >= 15, options
    shown = subprocess.run(["bash", str(RUN_SH), "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0
    missing = [option for option in options if option not in shown.stdout]
    assert not missing, missing
    wrong = subprocess.run(["bash", str(RUN_SH), "--no-such-option"], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "unknown option" in wrong.stderr
