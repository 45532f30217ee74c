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
