"""bench.linear_bench on tiny shapes: every backend gives every figure, the shares are the
figures over the peaks measured in the same run, the process is set up as the engine's, and bad
options get a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import linear_bench
from engine import kernels
from engine.heap import keep_heap_memory

TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--q-heads", "2", "--kv-heads", "1",
        "--head-dim", "32", "--vocab", "256", "--decode-rows", "1,4", "--prefill-rows", "96", "--repeats", "1"]


@pytest.mark.slow  # the peaks read 1 GiB of memory several times
def test_every_backend_reports_every_figure(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)  # main sets it, as `kvgate` does
    assert linear_bench.main([*TINY, "--json-out", str(tmp_path / "l.json"), "--plot-out", str(tmp_path / "l.png")]) == 0
    out = json.loads((tmp_path / "l.json").read_text())
    expected = ["panel", "onednn", "mkl"] if kernels.load() is not None else ["onednn", "mkl"]
    assert list(out["decode"]) == expected and list(out["prefill"]) == expected
    # measured as the engine runs: huge pages asked for, freed activations kept mapped
    assert out["machine"]["thp_mem_alloc"] == "1"
    assert out["machine"]["heap_kept"] == keep_heap_memory()
    peaks = out["peaks"]
    assert peaks["read_gb_s"] > 0 and peaks["mkl_sgemm_2048_gflop_s"] > 0
    params = 2 * ((2 + 2 * 1) * 32 * 64 + 64 * 64 + 2 * 128 * 64 + 64 * 128)
    assert out["layer_params"] == params and out["weight_bytes"] == (params + 256 * 64) * 4
    for backend in expected:
        for d in out["decode"][backend].values():
            assert d["weight_gb_s"] == pytest.approx(out["weight_bytes"] / (d["ms"] / 1e3) / 1e9)
            assert d["of_read"] == pytest.approx(d["weight_gb_s"] / peaks["read_gb_s"])
        d = out["prefill"][backend]["96"]
        assert d["gflop_s"] == pytest.approx(2 * 96 * params / (d["ms"] / 1e3) / 1e9)
    tables = capsys.readouterr().out
    assert "| decode rows |" in tables and "| prefill rows |" in tables
    assert (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_options_are_refused_with_a_clear_message(capsys) -> None:
    with pytest.raises(SystemExit):
        linear_bench.parse_args(["--backends", "cublas"])
    assert "unknown backend(s) cublas" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        linear_bench.parse_args(["--decode-rows", "1,x"])
    assert "comma-separated whole numbers" in capsys.readouterr().err
