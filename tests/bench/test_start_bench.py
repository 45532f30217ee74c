"""bench/start_bench.py: every phase of a start is measured, in order, for this tree and for
another commit's side by side; a server that cannot start is a one-line error."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench import start_bench


def test_a_start_is_measured_phase_by_phase_here_and_at_another_commit(tiny_model_dir, tmp_path, capsys) -> None:
    head = subprocess.run(["git", "-C", str(start_bench.ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    out_json, out_png = tmp_path / "start.json", tmp_path / "start.png"
    assert start_bench.main(["--models", str(tiny_model_dir), "--runs", "1", "--against", head,
                             "--json-out", str(out_json), "--plot-out", str(out_png)]) == 0
    result = json.loads(out_json.read_text())
    for tree in ("this", head):
        (run,) = result["raw"][str(tiny_model_dir)][tree]
        assert 0 < run["listening_s"] <= run["ready_s"] <= run["first_token_s"] < 120
        assert 0 < run["weights_s"] <= run["engine_ready_s"] <= run["ready_s"] + 1  # log stamps: ms resolution
    assert out_png.stat().st_size > 0
    table = capsys.readouterr().out
    assert f"| {tiny_model_dir} | this / {head} |" in table
    worktrees = subprocess.run(["git", "-C", str(start_bench.ROOT), "worktree", "list"], capture_output=True,
                               text=True).stdout
    assert "kvgate-start-bench-" not in worktrees  # the other commit's worktree is gone


def test_a_server_that_cannot_start_is_one_line(tmp_path, capsys) -> None:
    assert start_bench.main(["--models", str(tmp_path / "missing"), "--runs", "1", "--timeout-s", "60"]) == 1
    assert "before it was ready" in capsys.readouterr().err


def test_runs_below_one_are_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        start_bench.parse_args(["--runs", "0"])
    assert exc.value.code == 2
