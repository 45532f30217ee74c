"""CI-sized load tests: locust headless against a real `kvgate serve` (tiny model, two tenants).

`loadtest/locustfile.py` runs its four workloads for 20 s with one user each: no request may
fail, the shared-prefix workloads (one system prompt, a few hot documents) must get more than
half of their prompt tokens from the cache, conversations must reuse their history, and the
unique-prompt control must get (almost) none. Then `loadtest/run.sh` runs once end to end with
2 users for 15 s and must leave its CSV, summary and plot, and stop its server. There are no
timing assertions: the machine may be slow; only counts of tokens and requests are checked.
Every server is stopped and every folder removed.
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

from tests.app.conftest import ROOT, ServerProcess

pytestmark = pytest.mark.slow

LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
RUN_SH = ROOT / "loadtest" / "run.sh"
ADMIN_KEY = "loadtest-tests-admin"
KEYS = ("sk-loadtest-a", "sk-loadtest-b")
CONFIG = f"""
[model]
path = "tiny"

[admin]
api_key = "{ADMIN_KEY}"

[[tenants]]
name = "a"
api_keys = ["{KEYS[0]}"]

[[tenants]]
name = "b"
api_keys = ["{KEYS[1]}"]
"""
# Short texts and replies, little think time: many requests per user even on a slow machine.
WORKLOAD_ENV = {"KVGATE_SYSTEM_WORDS": "200", "KVGATE_DOC_WORDS": "300", "KVGATE_DOCS": "2",
                "KVGATE_UNIQUE_WORDS": "200", "KVGATE_TURN_WORDS": "30", "KVGATE_MAX_TOKENS": "4",
                "KVGATE_WAIT_S": "0.1"}
WORKLOADS = ("shared-system", "multi-turn", "document-qa", "unique")


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    """One temporary folder for this module (cache dir, server, outputs); removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="kvgate-loadtest-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def env(folder: Path) -> dict[str, str]:
    """Environment of servers and locust: a private cache dir (the tiny model is built once there)."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("KVGATE_CONFIG", "KVGATE_SECRET") and not k.startswith(("KVGATE_", "LOCUST_"))}
    return {**base, "KVGATE_CACHE_DIR": str(folder / "cache"), "OMP_NUM_THREADS": "1",
            "PYTHON": sys.executable, **WORKLOAD_ENV}


@pytest.fixture(scope="module")
def config_file(folder: Path) -> Path:
    path = folder / "kvgate.toml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def server(folder: Path, env: dict[str, str], config_file: Path) -> Iterator[ServerProcess]:
    """`kvgate serve` with two tenants, an admin key and a disk tier of its own."""
    (folder / "server").mkdir()
    process = ServerProcess(["--config", str(config_file), "--disk-cache", str(folder / "server" / "kv")],
                            folder / "server" / "server.log", env)
    try:
        process.wait_until("/ready")
        yield process
    finally:
        process.stop()


def read_stats(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    with path.open(newline="") as handle:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(handle)}


def test_the_workloads_reuse_their_prefixes_and_nothing_fails(server: ServerProcess, env: dict[str, str],
                                                              folder: Path) -> None:
    out = folder / "locust"
    out.mkdir()
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", server.url,
               "--users", "4", "--spawn-rate", "4", "--run-time", "20s", "--stop-timeout", "10",
               "--csv", str(out / "locust"), "--kv-report", str(out / "workloads.json"), "--only-summary"]
    done = subprocess.run(command, env={**env, "KVGATE_KEYS": ",".join(KEYS)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output

    stats = read_stats(out / "locust_stats.csv")
    assert all(row["Failure Count"] == "0" for row in stats.values()), output
    report = json.loads((out / "workloads.json").read_text())["workloads"]
    for name in WORKLOADS:
        requests = int(stats[("POST", name)]["Request Count"])
        assert requests >= 4, f"{name}: only {requests} requests in 20 s, too few to judge\n{output}"
        assert int(stats[("TTFT", name)]["Request Count"]) == requests == report[name]["requests"]
    rates = {name: report[name]["hit_rate"] for name in WORKLOADS}
    assert rates["shared-system"] > 0.5, (rates, output)
    assert rates["document-qa"] > 0.5, (rates, output)
    assert report["multi-turn"]["cached_tokens"] > 0, (rates, output)  # later turns reuse earlier ones
    assert rates["unique"] < 0.05, (rates, output)

    metrics = httpx.get(server.url + "/admin/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                        timeout=30).json()
    client_cached = sum(report[name]["cached_tokens"] for name in WORKLOADS)
    assert metrics["requests"]["cached_tokens_total"] >= client_cached > 0
    assert metrics["prefix_cache"]["hit_tokens"] > 0


def test_run_sh_writes_stats_summary_and_plot_and_stops_its_server(env: dict[str, str], folder: Path,
                                                                  config_file: Path) -> None:
    out = folder / "run"
    command = ["bash", str(RUN_SH), "--config", str(config_file), "--users", "2", "--spawn-rate", "2",
               "--run-time", "15s", "--workloads", "shared-system,document-qa", "--out", str(out),
               "--label", "ci", "--quiet", "--ready-timeout", "180"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output

    for name in ("locust_stats.csv", "workloads.json", "metrics_before.json", "metrics_after.json",
                 "summary.md", "summary.json", "server.log", "run.json"):
        assert (out / name).is_file(), f"{name} missing\n{output}"
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["label"] == "ci"
    assert summary["failures"] == 0 and summary["requests"] > 0, summary
    assert set(summary["workloads"]) == {"shared-system", "document-qa"}
    assert summary["workloads"]["shared-system"]["ttft_p50_ms"] is not None
    assert {"device", "host", "disk"} <= set(summary["tiers"])  # the config's keys reached /admin/metrics
    assert summary["tiers"]["device"]["hits"] > 0
    assert "| shared-system |" in (out / "summary.md").read_text()
    assert "| shared-system |" in done.stdout

    url = json.loads((out / "run.json").read_text())["url"]
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    assert "shutdown complete" in (out / "server.log").read_text()


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
