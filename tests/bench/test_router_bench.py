"""bench.router_bench on the tiny model, a few seconds per run: both policies over two fresh
replicas give every figure the JSON promises and lose nothing, and the kill run SIGKILLs replica b
half way through and loses no more requests than it had in flight. Every process it started is
gone afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import router_bench

SCENARIO = {"requests", "failures", "ttft_p50_ms", "ttft_p95_ms", "prompt_tokens", "cached_tokens", "cached_share",
            "tier_tokens", "device_host_share"}
TIERS = {"query_tokens", "hit_tokens", "device_tokens", "host_tokens", "disk_tokens", "remote_tokens", "hit_share",
         "device_host_share", "device_share", "host_share", "disk_share", "remote_share"}


def _children() -> set[str]:
    """This process's child processes (other tests' servers included)."""
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return set(path.read_text().split()) if path.exists() else set()


def _run(tiny_model_dir: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    argv = ["--model", str(tiny_model_dir), "--run-time", "4s", "--users", "4", "--json-out", str(tmp_path / "r.json"),
            "--plot-out", str(tmp_path / "r.png"), *extra]
    before = _children()
    status = router_bench.main(argv)
    assert _children() <= before  # every process it started is gone
    return status, json.loads((tmp_path / "r.json").read_text())


@pytest.mark.server  # redis-server, replicas, a router (and locust): docs/testing.md
@pytest.mark.slow
def test_both_policies_report_every_figure(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    status, out = _run(tiny_model_dir, tmp_path, "--skip-kill", "--workloads", "multi-turn,document-qa")
    assert status == 0
    assert list(out["runs"]) == ["round_robin", "prefix"]
    assert {"machine", "args", "workloads", "finished"} <= set(out)
    for name, run in out["runs"].items():
        assert set(run["scenarios"]) == {"multi-turn", "document-qa"}, name
        for scenario in run["scenarios"].values():
            assert set(scenario) == SCENARIO and scenario["requests"] > 0 and scenario["failures"] == 0
            # every cached token is attributed to the tier that served it
            assert sum(scenario["tier_tokens"].values()) == scenario["cached_tokens"]
            near = scenario["tier_tokens"].get("device", 0) + scenario["tier_tokens"].get("host", 0)
            assert scenario["device_host_share"] == pytest.approx(near / scenario["prompt_tokens"])
        assert set(run["tiers"]) == TIERS
        tiers = run["tiers"]
        assert tiers["query_tokens"] > 0 and 0 < tiers["hit_share"] <= 1
        parts = tiers["device_share"] + tiers["host_share"] + tiers["disk_share"] + tiers["remote_share"]
        assert parts == pytest.approx(tiers["hit_share"], abs=1e-9)
        assert tiers["device_host_share"] == pytest.approx(tiers["device_share"] + tiers["host_share"])
        assert run["failures"] == 0 and run["kill"] is None
        assert sum(r["routed"] for r in run["replicas"]) >= run["requests"]
        assert all(r["event_batches"] > 0 for r in run["replicas"])  # the KV events reached the router
    assert out["runs"]["prefix"]["decisions"]["prefix"] > 0
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.server  # redis-server, replicas, a router (and locust): docs/testing.md
@pytest.mark.slow
def test_a_replica_killed_half_way_loses_only_its_streams(tiny_model_dir: Path, tmp_path: Path,
                                                           monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    status, out = _run(tiny_model_dir, tmp_path, "--runs", "prefix_kill", "--workloads", "multi-turn,unique")
    run = out["runs"]["prefix_kill"]
    kill = run["kill"]
    assert kill["replica"] == "b" and 1.0 <= kill["at_s"] <= 4.0
    assert {"in_flight", "routed_before", "lost_at_most", "retried"} <= set(kill)
    assert run["failures"] <= kill["lost_at_most"] and status == 0
    assert not run["replicas"][1]["healthy"]  # out of rotation; a took the rest of the load
    assert run["replicas"][0]["routed"] > 0 and run["requests"] > 0


def test_help_names_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        router_bench.parse_args(["--help"])
    text = capsys.readouterr().out
    for option in ("--model", "--run-time", "--users", "--workloads", "--tenants", "--seed", "--device-blocks",
                   "--host-mb", "--threads", "--runs", "--skip-kill", "--keep", "--json-out", "--plot-out"):
        assert option in text, option
    assert "device+host share" in text  # the formulas


def test_run_time_syntax() -> None:
    assert [router_bench.seconds(t) for t in ("90", "90s", "2m", "1m30s")] == [90, 90, 120, 90]
    with pytest.raises(ValueError):
        router_bench.seconds("soon")
