"""TOML settings: defaults, overrides, `KVGATE_CONFIG`, unknown keys named, engine mapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import ConfigError, load_settings


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvgate.toml"
    path.write_text(text)
    return str(path)


def test_defaults_match_the_contract() -> None:
    settings = load_settings(env={})
    config = settings.engine_config()
    assert (config.model, config.dtype, config.max_model_len) == ("default", "float32", 4096)
    assert (config.block_size, config.num_blocks, config.max_queue) == (16, 1024, 256)
    assert (settings.server.host, settings.server.port) == ("127.0.0.1", 8000)
    assert settings.tenants == [] and settings.admin.api_key is None


def test_file_then_flags(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[model]
path = "/models/x"
dtype = "bfloat16"
max_model_len = 2048
[server]
port = 9000
max_queue = 8
[cache]
block_size = 32
[cache.device]
num_blocks = 64
[engine]
max_num_seqs = 4
""")
    config = load_settings(path, env={}).engine_config()
    assert (config.model, config.dtype, config.max_model_len, config.max_queue) == ("/models/x", "bfloat16", 2048, 8)
    assert (config.block_size, config.num_blocks, config.max_num_seqs) == (32, 64, 4)
    settings = load_settings(path, {"model.path": "tiny", "server.port": 1234, "server.host": None}, env={})
    assert settings.model.path == "tiny" and settings.server.port == 1234 and settings.server.host == "127.0.0.1"


def test_kvgate_config_env(tmp_path: Path) -> None:
    path = _write(tmp_path, "[server]\nport = 7777\n")
    assert load_settings(env={"KVGATE_CONFIG": path}).server.port == 7777
    assert load_settings(_write(tmp_path, "[server]\nport = 1\n"), env={"KVGATE_CONFIG": "/nope"}).server.port == 1


@pytest.mark.parametrize(("text", "named"), [
    ("[cache.devcie]\nnum_blocks = 3\n", "unknown key 'cache.devcie'"),
    ("[model]\npaht = 'x'\n", "unknown key 'model.paht'"),
    ("[[tenants]]\nname = 'a'\napi_keys = ['k']\nquota = { gpu = 1 }\n", "unknown key 'tenants[0].quota.gpu'"),
    ("[model]\ndtype = 'int8'\n", "'model.dtype'"),
    ("[cache.device]\nnum_blocks = 0\n", "'cache.device.num_blocks'"),
    ("[cache.remote]\nurl = 'http://x'\n", "'cache.remote.url'"),
    ("[cache.remote]\nwrite = 'sideways'\n", "'cache.remote.write'"),
    ("[cache.disk]\npersist = 'sometimes'\n", "'cache.disk.persist'"),
    ("[server]\nport = 'eighty'\n", "'server.port'"),
    ("[engine]\nmax_num_batched_tokens = 4\n", "max_num_batched_tokens"),
    ("not toml [", "not valid TOML"),
])
def test_bad_config_names_the_key(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=r".*") as info:
        load_settings(_write(tmp_path, text), env={})
    assert named in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings("/does/not/exist.toml", env={})


def test_host_and_disk_tiers_are_on_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    config = load_settings(env={}).engine_config()
    assert config.host_cache_mb == 1024
    assert config.disk_cache_path == str(tmp_path / "cache" / "kv") and config.disk_cache_mb == 10240
    off = load_settings(overrides={"cache.host.capacity_mb": 0, "cache.disk.capacity_mb": 0}, env={})
    assert off.engine_config().host_cache_mb == 0 and off.engine_config().disk_cache_path is None
    s3 = load_settings(_write(tmp_path, '[cache]\neviction = "s3fifo"\n[cache.disk]\npath = "/x/kv"\n'), env={})
    assert s3.engine_config().tier_policy == "s3fifo" and s3.engine_config().disk_cache_path == "/x/kv"
    with pytest.raises(ConfigError, match="eviction"):
        load_settings(_write(tmp_path, '[cache]\neviction = "mru"\n'), env={})


def test_disk_blocks_are_written_behind_by_default(tmp_path: Path) -> None:
    assert load_settings(env={}).engine_config().disk_persist == "behind"
    on_evict = load_settings(_write(tmp_path, '[cache.disk]\npersist = "on_evict"\n'), env={})
    assert on_evict.engine_config().disk_persist == "on_evict"
    idle = load_settings(_write(tmp_path, '[cache.disk]\npersist = "idle"\n'), env={})
    assert idle.engine_config().disk_persist == "idle"


def test_writes_behind_wait_up_to_their_delay_under_load(tmp_path: Path) -> None:
    assert load_settings(env={}).engine_config().disk_behind_delay_s == 10.0
    now = load_settings(_write(tmp_path, '[cache.disk]\nbehind_delay_s = 0\n'), env={})
    assert now.engine_config().disk_behind_delay_s == 0.0
    with pytest.raises(ConfigError, match="behind_delay_s"):
        load_settings(_write(tmp_path, '[cache.disk]\nbehind_delay_s = -1\n'), env={})


def test_remote_tier_settings_reach_the_engine(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[cache.host]
capacity_mb = 1024
[cache.disk]
path = "/tmp/kv"
capacity_mb = 10
[cache.remote]
url = "rediss://cache:6380/1"
cluster = true
ttl_s = 60
write = "back"
timeout_s = 1.5
""")
    config = load_settings(path, env={}).engine_config()
    assert (config.remote_cache_url, config.remote_cluster, config.remote_ttl_s, config.remote_write,
            config.remote_timeout_s) == ("rediss://cache:6380/1", True, 60, "back", 1.5)
    assert load_settings(env={}).engine_config().remote_cache_url is None
    off = load_settings(path, overrides={"cache.remote.url": ""}, env={})
    assert off.engine_config().remote_cache_url is None
    with pytest.raises(ConfigError, match="redis://"):
        load_settings(_write(tmp_path, '[cache.remote]\nurl = "http://x"\n'), env={})


def test_tenants_config_builds_a_registry(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[server]
secret = "0123456789abcdef0123"
[admin]
api_key = "adm"
[[tenants]]
name = "acme"
api_keys = ["k1", "k2"]
quota = { device = 512, host = 4096 }
[[tenants]]
name = "beta"
api_keys = ["k3"]
share_group = "g"
""")
    registry = load_settings(path, env={}).tenant_registry(env={})
    acme = registry.authenticate("k2")
    assert acme is not None and acme.name == "acme" and dict(acme.quota) == {"device": 512, "host": 4096}
    assert registry.authenticate("k3").namespace == "group:g"
    assert registry.is_admin("adm") and not registry.is_admin("k1")
    assert "k1" not in repr(load_settings(path, env={}))


def test_bad_tenants_are_config_errors(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[server]
secret = "0123456789abcdef0123"
[[tenants]]
name = "a"
api_keys = ["same"]
[[tenants]]
name = "b"
api_keys = ["same"]
""")
    with pytest.raises(ConfigError, match="also a key of tenant 'a'"):
        load_settings(path, env={}).tenant_registry(env={})
