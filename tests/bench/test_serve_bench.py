"""bench.serve_bench's options and tables, without starting servers: concurrency levels reach the
shared client with enough requests to fill them, the dtype reaches both servers, and the table
has a column per level."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import serve_bench


def test_levels_and_dtype_are_parsed_and_bad_levels_refused(capsys) -> None:
    args = serve_bench.parse_args(["--conc", "64,1,16,32,4", "--dtype", "bfloat16"])
    assert args.conc_list == [1, 4, 16, 32, 64] and args.dtype == "bfloat16"
    for bad in ("1,x", "0,4"):
        with pytest.raises(SystemExit):
            serve_bench.parse_args(["--conc", bad])
    assert "--conc" in capsys.readouterr().err


def test_vllm_gets_the_peers_command_with_the_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peers' script (a stand-in here: ../shared/peers is outside a clone) with its dtype swapped."""
    peers = tmp_path / "peers"
    peers.mkdir()
    (peers / "start_vllm.sh").write_text('exec vllm serve "$1" --port "$2" --dtype float32 --max-num-seqs 64\n')
    monkeypatch.setattr(serve_bench, "PEERS", peers)
    args = serve_bench.parse_args(["--dtype", "bfloat16"])
    command = serve_bench.vllm_command(args, tmp_path, 8123)
    assert command[:2] == ["bash", "-c"] and "--dtype bfloat16" in command[2] and "--dtype float32" not in command[2]
    assert "--max-num-seqs 64" in command[2] and command[-2:] == [str(tmp_path), "8123"]
    plain = serve_bench.vllm_command(serve_bench.parse_args([]), tmp_path, 8123)
    assert plain == ["bash", str(peers / "start_vllm.sh"), str(tmp_path), "8123"]
    (peers / "start_vllm.sh").write_text('exec vllm serve "$1" --port "$2"\n')
    with pytest.raises(SystemExit, match="no longer says --dtype float32"):
        serve_bench.vllm_command(args, tmp_path, 8123)


def test_the_table_has_a_column_per_level_and_ratios() -> None:
    rows = {"kvgate": {"tok_s_c1": 40.0, "tok_s_c64": 200.0, "ttft_p50_c64": 2.0, "cold_s": 1.0},
            "vllm": {"tok_s_c1": 20.0, "tok_s_c64": 100.0, "ttft_p50_c64": 4.0, "cold_s": 2.0}}
    text = serve_bench.table(rows, [1, 64])
    assert "tok/s c=64" in text and "TTFT p50 c=64 (s)" in text
    assert "| KVGate vs vLLM (>1 = KVGate better) | 2.00× | 2.00× | 2.00× | 2.00× |" in text


def test_interleaving_alternates_the_first_of_each_pair_and_merges_the_parts() -> None:
    assert serve_bench.parse_args(["--interleave"]).interleave and not serve_bench.parse_args([]).interleave
    assert serve_bench.parts([1, 16]) == [["--workloads", "a", "--conc", "1"], ["--workloads", "a", "--conc", "16"],
                                          ["--workloads", "b"]]
    firsts = [serve_bench.pair_order(run, part)[0] for run in (1, 2) for part in range(3)]
    assert firsts == ["vllm", "kvgate", "vllm", "kvgate", "vllm", "kvgate"]
    assert all(sorted(serve_bench.pair_order(run, part)) == ["kvgate", "vllm"] for run in (1, 2) for part in range(3))
    a1 = {"conc": 1, "tok_s": 30.0, "ttft_p50_s": 0.2}
    a16 = {"conc": 16, "tok_s": 90.0, "ttft_p50_s": 3.0}
    b = {"cold": {"ttft_median_s": 4.0}}
    merged = serve_bench.merge([{"a": [a1]}, {"a": [a16]}, {"a": [], "b": b}])
    assert merged == {"a": [a1, a16], "b": b}
    assert serve_bench.figures(merged) == {"tok_s_c1": 30.0, "tok_s_c16": 90.0, "ttft_p50_c1": 0.2,
                                           "ttft_p50_c16": 3.0, "cold_s": 4.0}


def test_pair_ratios_are_taken_per_run_before_the_median() -> None:
    kvgate = [{"tok_s_c16": 100.0, "cold_s": 4.0}, {"tok_s_c16": 60.0, "cold_s": 5.0}, {"tok_s_c16": 90.0}]
    vllm = [{"tok_s_c16": 50.0, "cold_s": 8.0}, {"tok_s_c16": 60.0, "cold_s": 5.0}, {"tok_s_c16": 100.0}]
    ratios = serve_bench.pair_ratios(kvgate, vllm)
    # per run 2.0, 1.0, 0.9 -> 1.0; the ratio of the medians (90 / 60) would say 1.5
    assert ratios["tok_s_c16"] == pytest.approx(1.0) and ratios["cold_s"] == pytest.approx(1.5)
    rows = {"kvgate": serve_bench.medians(kvgate), "vllm": serve_bench.medians(vllm)}
    text = serve_bench.table(rows, [16], ratios)
    assert "| KVGate vs vLLM (>1 = KVGate better) | 1.50× |" in text
    assert "| median of the per-pair ratios | 1.00× | — | 1.50× | — | — |" in text
    assert "per-pair" not in serve_bench.table(rows, [16])


def test_interleaving_needs_vllm(capsys) -> None:
    assert serve_bench.main(["--interleave", "--load-py", __file__]) == 2
    assert "pass --vllm-python" in capsys.readouterr().err


def test_the_quiet_wait_sees_a_busy_session_and_an_idle_one() -> None:
    """A process spinning on a core keeps the wait going until its timeout; a sleeping one not."""
    import subprocess
    import sys
    import time

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    idle = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        time.sleep(0.3)
        assert serve_bench.cpu_seconds([busy.pid]) > 0.0
        assert serve_bench.wait_quiet([busy.pid], timeout_s=1.5, window_s=0.5) >= 1.5
        assert serve_bench.wait_quiet([idle.pid], timeout_s=5.0, window_s=0.5) < 1.5
    finally:
        for proc in (busy, idle):
            proc.kill()
            proc.wait()


def test_kvgate_gets_a_fresh_disk_tier_unless_its_arguments_name_one(tmp_path: Path) -> None:
    command = serve_bench.kvgate_command(serve_bench.parse_args(["--kvgate-args", "--host-cache-mb 64"]),
                                         "kvgate", 8123, tmp_path / "kv")
    assert command[:2] == ["kvgate", "serve"] and command[command.index("--port") + 1] == "8123"
    assert command[-4:] == ["--host-cache-mb", "64", "--disk-cache", str(tmp_path / "kv")]
    own = serve_bench.kvgate_command(serve_bench.parse_args(["--kvgate-args", "--disk-cache /x"]),
                                     "kvgate", 8123, tmp_path / "kv")
    assert own.count("--disk-cache") == 1 and own[-1] == "/x"
