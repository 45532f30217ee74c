"""bench/survival_bench.py: the --persist settings it takes and the config each one writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from bench import survival_bench


@pytest.mark.parametrize(("text", "ok"), [("behind", True), ("on_evict", True), ("idle", True), ("unset", True),
                                          ("behind:0", True), ("behind:2.5", True), ("behind:-1", False),
                                          ("behind:soon", False), ("idle:3", False), ("later", False)])
def test_persist_settings(text: str, ok: bool) -> None:
    assert survival_bench._persist_setting(text) is ok


def test_each_setting_writes_its_disk_section(tmp_path: Path) -> None:
    def disk(persist: str) -> dict:
        return tomllib.loads(survival_bench.server_config(tmp_path / "kv", persist))["cache"]["disk"]

    assert disk("unset") == {"path": str(tmp_path / "kv")}
    assert disk("behind")["persist"] == "behind" and "behind_delay_s" not in disk("behind")
    assert disk("behind:0") == {"path": str(tmp_path / "kv"), "persist": "behind", "behind_delay_s": 0.0}


def test_a_bad_setting_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert survival_bench.main(["--persist", "behind:soon", "--scenarios", "kill9"]) == 2
    assert "behind:<seconds>" in capsys.readouterr().err
