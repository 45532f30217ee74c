"""bench/survival_bench.py: the --persist settings it takes and the config each one writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from bench import survival_bench


@pytest.mark.parametrize(("text", "parsed"), [
    ("behind", ("behind", None)), ("on_evict", ("on_evict", None)), ("idle", ("idle", None)),
    ("unset", ("unset", None)), ("behind:0", ("behind", 0.0)), ("behind:2.5", ("behind", 2.5)),
    ("behind:-1", None), ("behind:soon", None), ("idle:3", None), ("later", None)])
def test_persist_settings(text: str, parsed: tuple[str, float | None] | None) -> None:
    assert survival_bench.parse_persist(text) == parsed


def test_each_setting_writes_its_disk_section(tmp_path: Path) -> None:
    def disk(persist: str) -> dict:
        return tomllib.loads(survival_bench.server_config(tmp_path / "kv", persist))["cache"]["disk"]

    assert disk("unset") == {"path": str(tmp_path / "kv")}
    assert disk("behind")["persist"] == "behind" and "behind_delay_s" not in disk("behind")
    assert disk("behind:0") == {"path": str(tmp_path / "kv"), "persist": "behind", "behind_delay_s": 0.0}
    with pytest.raises(ValueError, match="later"):
        survival_bench.server_config(tmp_path / "kv", "later")


def test_a_bad_setting_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert survival_bench.main(["--persist", "behind:soon", "--scenarios", "kill9"]) == 2
    assert "behind:<seconds>" in capsys.readouterr().err
