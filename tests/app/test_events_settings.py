"""`[events]`: one key turns KV events on; a bad endpoint is refused at load with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import ConfigError, load_settings
from tests.app.test_settings import _write

pytestmark = pytest.mark.unit


def test_events_are_off_by_default() -> None:
    config = load_settings(env={}).engine_config()
    assert config.kv_events_endpoint is None and config.kv_events_replay_endpoint is None


def test_the_endpoint_reaches_the_engine(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[events]
endpoint = "tcp://*:5557"
replay_endpoint = "tcp://*:5558"
topic = "kv"
max_queue = 500
""")
    config = load_settings(path, env={}).engine_config()
    assert (config.kv_events_endpoint, config.kv_events_replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    assert (config.kv_events_topic, config.kv_events_max_queue) == ("kv", 500)


@pytest.mark.parametrize("text, key", [
    ('endpoint = "localhost:5557"', "events.endpoint"),
    ('replay_endpoint = "http://x:1"', "events.replay_endpoint"),
    ("max_queue = 0", "events.max_queue"),
    ('publish = true', "events.publish"),
])
def test_bad_events_settings_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_settings(_write(tmp_path, f"[events]\n{text}\n"), env={})
