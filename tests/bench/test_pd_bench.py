"""bench.pd_bench on the tiny model, a few seconds per setup: the disaggregated pipeline (prefill
and decode replicas) and two mixed replicas, each behind `kvgate route`, give every figure the
JSON promises, fail nothing, route every request of the pipeline in two legs (the decode replica
loading the prompts' blocks from Redis), and stream the same greedy chats. Every process it
started is gone afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import pd_bench

FIGURES = {"chats", "chat_tokens", "chat_tokens_per_s", "chat_prompt_tokens_mean", "chat_chunks_per_stream",
           "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms", "itl_max_ms", "itl_samples",
           "docs", "doc_ttft_p50_ms", "doc_ttft_p95_ms", "failures", "failure_examples", "wall_s", "decisions",
           "replicas"}


@pytest.mark.server  # redis-server, replicas, a router (and locust): docs/testing.md
@pytest.mark.slow
def test_both_setups_report_every_figure_and_agree(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["--model", str(tiny_model_dir), "--duration", "3", "--chats", "2", "--chat-tokens", "8", "--docs", "1",
            "--doc-tokens", "400", "--json-out", str(tmp_path / "pd.json"), "--plot-out", str(tmp_path / "pd.png")]
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    before = set(path.read_text().split()) if path.exists() else set()
    assert pd_bench.main(argv) == 0
    assert (set(path.read_text().split()) if path.exists() else set()) <= before  # every process it started is gone
    out = json.loads((tmp_path / "pd.json").read_text())
    assert list(out["setups"]) == ["disaggregated", "mixed"]
    for name, s in out["setups"].items():
        assert set(s) == FIGURES, name
        assert s["chats"] > 0 and s["docs"] > 0 and s["failures"] == {"chat": 0, "doc": 0}
        assert s["chat_tokens"] == 8 * s["chats"] and s["itl_samples"] > 0
        assert s["ttft_p50_ms"] <= s["ttft_p95_ms"] and s["itl_p50_ms"] <= s["itl_p95_ms"] <= s["itl_p99_ms"]
    pipeline = out["setups"]["disaggregated"]
    requests = pipeline["chats"] + pipeline["docs"]
    assert pipeline["decisions"]["disaggregated"] >= requests
    prefill, decode = pipeline["replicas"]
    assert (prefill["role"], decode["role"]) == ("prefill", "decode")
    assert prefill["shipped"]["prompts"] >= requests and decode["redis_tokens_loaded"] > 0
    assert out["setups"]["mixed"]["decisions"]["disaggregated"] == 0
    outputs = out["outputs"]
    assert outputs["compared"] > 0 and outputs["identical"] == outputs["compared"] and outputs["different"] == []
    assert (tmp_path / "pd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_names_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        pd_bench.parse_args(["--help"])
    text = capsys.readouterr().out
    for option in ("--model", "--duration", "--chats", "--chat-words", "--chat-tokens", "--docs", "--doc-tokens",
                   "--doc-max-tokens", "--setups", "--seed", "--device-blocks", "--host-mb", "--threads", "--keep",
                   "--json-out", "--plot-out"):
        assert option in text, option


def test_percentiles_and_output_comparison() -> None:
    assert pd_bench.pct([], 50) is None
    assert [pd_bench.pct(list(range(1, 101)), q) for q in (50, 95, 99, 100)] == [50, 95, 99, 100]
    same = pd_bench.compare({"x": {"0.0": "a", "0.1": "b", "1.0": "c"}, "y": {"0.0": "a", "0.1": "B"}})
    assert same == {"compared": 2, "identical": 1, "different": ["0.1"]}
