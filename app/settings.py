"""Server settings: the TOML file of CONTRACT.md, `KVGATE_CONFIG`, and CLI flag overrides.

Every key has a default; an unknown key is an error that names it (a typo must not silently
fall back to a default). Precedence: flags > file (`--config`, else `$KVGATE_CONFIG`) > defaults.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.config import EngineConfig
from tenants.limits import TenantLimits
from tenants.public import check_name
from tenants.registry import TenantRegistry, TenantSpec, load_server_secret, store_mac_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key and why."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(_Section):
    path: str = "default"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: int = Field(default=4096, gt=0)


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_queue: int = Field(default=256, gt=0)
    secret: str | None = Field(default=None, repr=False)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    shutdown_timeout_s: float = Field(default=10.0, ge=0)
    # Most engine sequences one request may start (prompts in a list × n); larger requests get 400.
    max_fanout: int = Field(default=128, gt=0)
    # /docs and /openapi.json: public | auth (any tenant or the admin key) | off;
    # default: public without tenants, auth once tenants are configured.
    docs: Literal["public", "auth", "off"] | None = None
    # both: a whole replica; prefill / decode: one side of a Disaggregated-Pipeline, the KV
    # shipped through the shared store ([cache.remote]; docs/disaggregated.md)
    role: Literal["both", "prefill", "decode"] = "both"

    def docs_mode(self, has_tenants: bool) -> str:
        if self.docs is not None:
            return self.docs
        return "auth" if has_tenants else "public"


class EngineSettings(_Section):
    """Scheduler and runtime knobs (an extension of the contract's keys)."""

    device: str = "auto"
    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    num_threads: int | None = Field(default=None, gt=0)
    enable_prefix_caching: bool = True
    pack_weights: bool = True
    native_kernels: bool = True  # CPU float32: KVGate's paged-attention kernel and fused ops (built once with g++)
    fast_decoder: bool = True  # Llama-family layers run by engine.fast_decoder instead of transformers' modules
    metrics: bool = True  # the detailed engine metrics (TTFT parts, block lives); off only to measure their cost


class DeviceCacheSettings(_Section):
    num_blocks: int = Field(default=1024, ge=2)


class HostCacheSettings(_Section):
    capacity_mb: int = Field(default=1024, ge=0)  # 0 turns the host tier off


class DiskCacheSettings(_Section):
    path: str | None = None  # default: <KVGATE_CACHE_DIR>/kv
    capacity_mb: int = Field(default=10240, ge=0)  # 0 turns the disk tier off
    # deadline of one batch of block reads; past it the request recomputes (a stalled disk hangs nothing)
    load_timeout_s: float = Field(default=0.5, gt=0, le=60)
    # where POST /admin/tiers may attach a disk tier (absolute; unset: anywhere but system folders)
    allowed_root: str | None = None
    # behind: blocks are also written in the background as they are computed, so a crash loses
    # only the last moments' blocks and evicting them costs no write; idle: the same, but only on
    # CPU time nobody else wants (fully loaded, it writes only what leaves host memory); on_evict:
    # a block is written when it leaves host memory (docs/tiers.md, "Crash loss")
    persist: Literal["on_evict", "behind", "idle"] = "behind"
    # behind: while steps run back to back, a computed block's write waits up to this long (the
    # writes cost the steps ~10 % of their CPU), so a burst of load shorter than this runs at full
    # speed and a crash loses at most this long's blocks; an idle moment writes them at once
    behind_delay_s: float = Field(default=10.0, ge=0, le=3600)
    # how blocks are encoded on disk: none (as they are, lossless) | bf16 | fp16 | int8 (lossy,
    # 2x / 2x / ~4x smaller; int8 agrees on the top-1 token below 99 % of the time, see
    # docs/benchmarks.md "Codec quality"); records of any codec are read (docs/tiers.md, "Codecs")
    codec: Literal["none", "bf16", "fp16", "int8"] = "none"

    def resolved_path(self) -> str:
        from engine.tiny_model import cache_root

        return self.path if self.path else str(cache_root() / "kv")

    @field_validator("allowed_root")
    @classmethod
    def _absolute(cls, root: str | None) -> str | None:
        if root is not None and not os.path.isabs(root):
            raise ValueError("must be an absolute path")
        return root


class RemoteCacheSettings(_Section):
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    ttl_s: int = Field(default=86400, gt=0)
    # through: every block as computed | back: when it leaves CPU memory (and is admitted, see
    # [cache] admit) | selective: once a request reuses it (docs/tiers.md, "Admission")
    write: Literal["through", "back", "selective"] = "through"
    # how long one pipeline may take before it counts as a failure (three in a row open the breaker)
    timeout_s: float = Field(default=0.5, gt=0)
    # how values are encoded in the store, as [cache.disk] codec
    codec: Literal["none", "bf16", "fp16", "int8"] = "none"

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        if url and not url.startswith(("redis://", "rediss://")):  # "" = off (the CLI's --remote-cache off)
            raise ValueError("must start with redis:// or rediss://")
        return url


class CacheSettings(_Section):
    block_size: int = Field(default=16, gt=0)
    eviction: Literal["lru", "s3fifo"] = "lru"  # the host and disk tiers' policy
    # always: every block leaving CPU memory is written to disk; second_use: only a block a later
    # request reused (or computed again after it was dropped) (docs/tiers.md, "Admission")
    admit: Literal["always", "second_use"] = "always"
    device: DeviceCacheSettings = DeviceCacheSettings()
    host: HostCacheSettings = HostCacheSettings()
    disk: DiskCacheSettings = DiskCacheSettings()
    remote: RemoteCacheSettings | None = None


class EventsSettings(_Section):
    """KV events: every stored and removed block announced on a ZMQ PUB socket, in vLLM's layout
    (engine/kv_events.py, docs/events.md). One key turns them on: ``endpoint``."""

    endpoint: str | None = None  # where the PUB socket binds, e.g. tcp://*:5557 (unset: no events)
    topic: str = ""  # the first frame of every message (subscribers filter on it)
    # a ZMQ ROUTER a subscriber asks for the batches it missed (unset: no replay)
    replay_endpoint: str | None = None
    # events queued for the publisher thread at most; past it a batch is dropped and counted
    max_queue: int = Field(default=100_000, gt=0)

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError("must be a ZMQ endpoint: tcp://HOST:PORT, ipc://PATH (e.g. tcp://*:5557)")
        return endpoint


class AdminSettings(_Section):
    api_key: str | None = Field(default=None, repr=False)


class QuotaSettings(_Section):
    device: int | None = Field(default=None, ge=0)
    host: int | None = Field(default=None, ge=0)
    disk: int | None = Field(default=None, ge=0)
    remote: int | None = Field(default=None, ge=0)


class RateSettings(_Section):
    """`rate = { requests_per_s, burst, tokens_per_min }` of a tenant (each optional, absent = unlimited).

    `burst` (default: `requests_per_s` rounded up) is how many requests may arrive at once;
    `tokens_per_min` counts each request's prompt tokens plus `max_tokens × n` at admission.
    """

    requests_per_s: float | None = Field(default=None, gt=0, strict=True, allow_inf_nan=False)
    burst: int | None = Field(default=None, gt=0, strict=True)
    tokens_per_min: int | None = Field(default=None, gt=0, strict=True)


class TenantSettings(_Section):
    name: str
    api_keys: list[str] = Field(repr=False)
    share_group: str = ""
    quota: QuotaSettings = QuotaSettings()
    rate: RateSettings = RateSettings()
    max_concurrent: int | None = Field(default=None, gt=0, strict=True)  # requests in flight, streams included

    @model_validator(mode="after")
    def _burst_needs_a_rate(self) -> TenantSettings:
        if self.rate.burst is not None and self.rate.requests_per_s is None:
            raise ValueError(f"tenant {self.name!r}: rate.burst needs rate.requests_per_s")
        return self


class PublicPrefixSettings(_Section):
    """One `[[public_prefixes]]` entry: text every tenant may share the KV of, given as exactly one
    of `text` (a completion prompt's beginning), `system` (a chat's system message, rendered with
    the model's chat template) or `token_ids`."""

    name: str
    text: str | None = None
    system: str | None = None
    token_ids: list[int] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value)

    @model_validator(mode="after")
    def _one_source(self) -> PublicPrefixSettings:
        given = [k for k in ("text", "system", "token_ids") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"public prefix {self.name!r} needs exactly one non-empty of text, system, "
                             f"token_ids (got {', '.join(given) or 'none'})")
        return self


class Settings(_Section):
    """The whole configuration file."""

    model: ModelSettings = ModelSettings()
    server: ServerSettings = ServerSettings()
    engine: EngineSettings = EngineSettings()
    cache: CacheSettings = CacheSettings()
    events: EventsSettings = EventsSettings()
    admin: AdminSettings = AdminSettings()
    tenants: list[TenantSettings] = []
    public_prefixes: list[PublicPrefixSettings] = []

    def engine_config(self, env: Mapping[str, str] | None = None) -> EngineConfig:
        """The engine's view of this configuration. Its `store_mac_key`, which seals the records of
        the shared store, comes from the server secret (loaded or created as `tenant_registry` does)."""
        try:
            mac_key = store_mac_key(load_server_secret(self.server.secret, env))
        except ValueError as exc:
            raise ConfigError(f"invalid server secret: {exc}") from exc
        try:
            return EngineConfig(
                model=self.model.path, dtype=self.model.dtype, device=self.engine.device,
                max_model_len=self.model.max_model_len, block_size=self.cache.block_size,
                num_blocks=self.cache.device.num_blocks, max_num_seqs=self.engine.max_num_seqs,
                max_num_batched_tokens=self.engine.max_num_batched_tokens,
                max_queue=self.server.max_queue,
                enable_prefix_caching=self.engine.enable_prefix_caching,
                num_threads=self.engine.num_threads,
                pack_weights=self.engine.pack_weights,
                native_kernels=self.engine.native_kernels,
                fast_decoder=self.engine.fast_decoder,
                metrics=self.engine.metrics,
                host_cache_mb=self.cache.host.capacity_mb,
                disk_cache_path=self.cache.disk.resolved_path() if self.cache.disk.capacity_mb > 0 else None,
                disk_cache_mb=max(1, self.cache.disk.capacity_mb),
                disk_load_timeout_s=self.cache.disk.load_timeout_s,
                disk_allowed_root=self.cache.disk.allowed_root,
                tier_policy=self.cache.eviction,
                disk_persist=self.cache.disk.persist,
                disk_behind_delay_s=self.cache.disk.behind_delay_s,
                admit=self.cache.admit,
                disk_codec=self.cache.disk.codec,
                flush_on_shutdown_s=min(10.0, self.server.shutdown_timeout_s + 5.0),
                role=self.server.role,
                kv_events_endpoint=self.events.endpoint,
                kv_events_topic=self.events.topic,
                kv_events_replay_endpoint=self.events.replay_endpoint,
                kv_events_max_queue=self.events.max_queue,
                store_mac_key=mac_key,
                **self._remote_fields(),
            )
        except ValueError as exc:
            raise ConfigError(f"invalid engine configuration: {exc}") from exc

    def _remote_fields(self) -> dict[str, Any]:
        remote = self.cache.remote
        if remote is None or not remote.url:
            return {}
        return {"remote_cache_url": remote.url, "remote_cluster": remote.cluster, "remote_ttl_s": remote.ttl_s,
                "remote_write": remote.write, "remote_timeout_s": remote.timeout_s, "remote_codec": remote.codec}

    def tenant_registry(self, env: Mapping[str, str] | None = None) -> TenantRegistry:
        """Hash the keys and derive the salts (loads or creates the server secret)."""
        try:
            secret = load_server_secret(self.server.secret, env)
            specs = [
                TenantSpec(t.name, tuple(t.api_keys), t.share_group,
                           {k: v for k, v in t.quota.model_dump().items() if v is not None},
                           TenantLimits(t.rate.requests_per_s, t.rate.burst, t.rate.tokens_per_min,
                                        t.max_concurrent))
                for t in self.tenants
            ]
            return TenantRegistry.build(specs, secret, self.admin.api_key)
        except ValueError as exc:
            raise ConfigError(f"invalid tenants configuration: {exc}") from exc


def _format_errors(exc: ValidationError, data: Mapping[str, Any] | None = None) -> str:
    lines = []
    for error in exc.errors():
        key = ""
        for part in error["loc"]:
            key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
        where = _entry_name(data, error["loc"])
        if error["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'{where}")
        else:
            lines.append(f"'{key}'{where}: {error['msg']}")
    return "; ".join(lines)


def _entry_name(data: Mapping[str, Any] | None, loc: tuple[Any, ...]) -> str:
    """` (tenant 'acme')` for an error inside a named `[[tenants]]` entry, so the message names it."""
    if data is None or len(loc) < 3 or loc[0] != "tenants" or not isinstance(loc[1], int):
        return ""
    entries = data.get("tenants")
    if not isinstance(entries, list) or not 0 <= loc[1] < len(entries) or not isinstance(entries[loc[1]], dict):
        return ""
    name = entries[loc[1]].get("name")
    return f" (tenant {name!r})" if isinstance(name, str) else ""


def load_settings(config: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None,
                  env: Mapping[str, str] | None = None) -> Settings:
    """Read the TOML file (`config`, else `$KVGATE_CONFIG`, else none) and apply overrides.

    `overrides` maps dotted keys (`"model.path"`, `"server.port"`) to values; None values are
    skipped so unset CLI flags do not override the file.
    """
    env = os.environ if env is None else env
    path = config if config is not None else env.get("KVGATE_CONFIG") or None
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with Path(path).open("rb") as handle:
                data = tomllib.load(handle)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section = data
        *parents, leaf = dotted.split(".")
        for name in parents:
            section = section.setdefault(name, {})
        section[leaf] = value
    try:
        settings = Settings.model_validate(data)
    except ValidationError as exc:
        where = f" in {path}" if path is not None else ""
        raise ConfigError(f"invalid configuration{where}: {_format_errors(exc, data)}") from exc
    settings.engine_config(env)  # surface engine-level errors (and a bad server secret) at load time
    return settings


def log_settings_warnings(settings: Settings) -> None:
    """Warn about configurations that are accepted but probably not what was meant."""
    if settings.tenants and settings.admin.api_key is None:
        logger.warning("tenants are configured but [admin] api_key is not: /admin/* is locked")
