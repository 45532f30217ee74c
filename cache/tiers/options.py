"""What the API process knows about the tiers: each kind's options (pydantic models, the one
validation they get) and the check an attach runs before the engine is asked (`reach_store`).

Nothing here imports torch or a tier's implementation, so the server's API process, the router
and the configuration loader validate tier options without loading either; the tiers themselves
(cache/tiers/factory.py builds them) run in the engine process.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


# how a store encodes the blocks it writes (cache/tiers/kv_codec.py); the host tier has none: it
# shares its rows with the device pool. A codec's index is its id in the record header.
CODECS = ("none", "bf16", "fp16", "int8")
Codec = Literal["none", "bf16", "fp16", "int8"]
assert CODECS == Codec.__args__  # type: ignore[attr-defined]

LOAD_TIMEOUT_S = 0.5  # default deadline of one disk read batch (`[cache.disk] load_timeout_s`)


class HostOptions(_Options):
    capacity_mb: int = Field(gt=0)


class DiskOptions(_Options):
    path: str = Field(min_length=1)
    capacity_mb: int = Field(default=10240, gt=0)
    load_timeout_s: float = Field(default=LOAD_TIMEOUT_S, gt=0)
    codec: Codec = "none"


class RemoteOptions(_Options):
    url: str
    cluster: bool = False
    ttl_s: int = Field(default=86400, gt=0)
    write: Literal["through", "back", "selective"] = "through"
    timeout_s: float = Field(default=0.5, gt=0)
    codec: Codec = "none"
    # the deployment's store key (cache.tiers.store_mac): from the engine's configuration only,
    # never from a request (not in `http_fields`), never shown
    mac_key: bytes | None = Field(default=None, repr=False, exclude=True)

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://")):
            raise ValueError(f"the remote tier needs a url starting with redis:// or rediss://, got {url!r}")
        return url


def safe_url(url: str) -> str:
    """``url`` without its password (never logged or shown)."""
    if "@" in url:
        scheme, rest = url.split("://", 1)
        url = f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


async def reach_store(url: str, cluster: bool = False, timeout_s: float = 2.0) -> str | None:
    """None if the store at ``url`` answers a PING within ``timeout_s``, else why not (a line).
    An attach asks this first, from the API process, so that a store nobody listens at is
    refused instead of attached, and the step loop never waits on the network for it."""
    kwargs: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    client: Any = None
    try:
        if cluster:
            from redis.asyncio.cluster import RedisCluster

            client = RedisCluster.from_url(url, **kwargs)
        else:
            from redis.asyncio import Redis

            client = Redis.from_url(url, **kwargs)
        await asyncio.wait_for(client.ping(), timeout_s)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (no answer in {timeout_s:g} s)"
    finally:
        if client is not None:
            try:
                await client.aclose()
            except Exception:  # a half-open connection may fail to close; it is dropped either way
                pass
    return None
