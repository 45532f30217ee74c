"""`[cache] admit` and `[cache.remote] write = "selective"`: from the file to the engine and the
tier options, and a bad value named with the allowed ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import ConfigError, load_settings
from cache.tiers import factory
from engine.config import EngineConfig
from tests.app.test_codec_settings import _write

pytestmark = pytest.mark.unit


def test_admission_reaches_the_engine_and_the_remote_options(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[cache]
admit = "second_use"
[cache.remote]
url = "redis://cache:6379/0"
write = "selective"
""")
    config = load_settings(path, env={}).engine_config()
    assert (config.admit, config.remote_write) == ("second_use", "selective")
    assert config.tier_options()["remote"]["write"] == "selective"
    defaults = load_settings(env={}).engine_config()
    assert (defaults.admit, defaults.remote_write) == ("always", "through")


def test_bad_admission_values_name_the_key_and_the_allowed_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(_write(tmp_path, '[cache]\nadmit = "third_use"\n'), env={})
    assert "cache.admit" in str(info.value) and "second_use" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_settings(_write(tmp_path, '[cache.remote]\nwrite = "around"\n'), env={})
    assert "cache.remote.write" in str(info.value) and "selective" in str(info.value)
    with pytest.raises(ValueError, match="admit must be always or second_use"):
        EngineConfig(admit="never")
    with pytest.raises(ValueError, match="selective"):
        factory.validate("remote", {"url": "redis://x:6379/0"}, {"write": "around"})
