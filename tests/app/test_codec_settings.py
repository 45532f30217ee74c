"""`[cache.disk] codec` and `[cache.remote] codec`: from the file to the engine and the tiers'
options, attachable over HTTP, and a bad value named with the allowed ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import ConfigError, load_settings
from cache.tiers import factory
from engine.config import EngineConfig


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvgate.toml"
    path.write_text(text)
    return str(path)


def test_codecs_reach_the_engine_and_the_tiers_options(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[cache.disk]
path = "/tmp/kv"
codec = "bf16"
[cache.remote]
url = "redis://cache:6379/0"
codec = "int8"
""")
    config = load_settings(path, env={}).engine_config()
    assert (config.disk_codec, config.remote_codec) == ("bf16", "int8")
    options = config.tier_options()
    assert options["disk"]["codec"] == "bf16" and options["remote"]["codec"] == "int8"
    defaults = load_settings(env={}).engine_config()
    assert (defaults.disk_codec, defaults.remote_codec) == ("none", "none")


@pytest.mark.parametrize("section", ["disk", "remote"])
def test_a_bad_codec_names_the_key_and_the_allowed_values(tmp_path: Path, section: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(_write(tmp_path, f'[cache.{section}]\ncodec = "zstd"\n'), env={})
    message = str(info.value)
    assert f"cache.{section}.codec" in message and all(c in message for c in ("none", "bf16", "fp16", "int8"))
    with pytest.raises(ValueError, match=f"{section}_codec must be one of none, bf16, fp16, int8"):
        EngineConfig(**{f"{section}_codec": "zstd"})  # type: ignore[arg-type]


def test_codec_is_an_option_post_admin_tiers_may_set() -> None:
    chosen = factory.validate("disk", {"path": "/tmp/kv"}, {"codec": "fp16"})
    assert chosen.codec == "fp16"  # type: ignore[attr-defined]
    chosen = factory.validate("remote", {"url": "redis://x:6379/0"}, {"codec": "int8"})
    assert chosen.codec == "int8"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="codec") as info:
        factory.validate("remote", {"url": "redis://x:6379/0"}, {"codec": "gzip"})
    assert "'none', 'bf16', 'fp16' or 'int8'" in str(info.value)
    with pytest.raises(ValueError, match="unknown option"):
        factory.validate("host", {"capacity_mb": 1}, {"codec": "bf16"})  # host has none: it shares the pool's rows
