"""Request and response models of the cache control API (`/v1/cache/*`, docs/cache_api.md).

Requests are as strict as the completion routes' (`RequestModel`: no coercion, unknown fields
refused, valid Unicode only). A prefix is named as a completion names its prompt (`prompt`: a
string or token ids) or as a chat does (`messages`, rendered with the chat template), never both;
`cache_salt` narrows it as it narrows a request's. The admin key acts for a tenant it names in
`tenant`; a tenant's key may not name one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.protocol import ChatMessage, RequestModel

DEFAULT_TTL_S = 300.0
MIN_TTL_S = 1.0
MAX_TTL_S = 3600.0


class CachePrefix(RequestModel):
    """What names a prefix, and whose: the fields every cache control request shares."""

    prompt: str | list[int] | None = Field(default=None, description="the prefix as a completion prompt: text (tokenized "
                                           "as /v1/completions does) or token ids")
    messages: list[ChatMessage] | None = Field(default=None, description="the prefix as a chat, rendered with the "
                                               "model's chat template as /v1/chat/completions does (the "
                                               "assistant turn opened)")
    cache_salt: str | None = Field(default=None, description="the request's cache_salt, if its requests send one")
    model: str | None = Field(default=None, description="optional; when given it must name the served model")
    tenant: str | None = Field(default=None, description="admin key only: the tenant to act for (a tenant's key "
                                                 "naming one gets 403)")


class CacheLookupRequest(CachePrefix):
    """`POST /v1/cache/lookup`: how much of a prompt is cached, and where (nothing is loaded)."""


class CachePrefetchRequest(CachePrefix):
    """`POST /v1/cache/prefetch`: load a prefix from disk or Redis into host memory now, and keep
    it from eviction for `ttl_s` seconds."""

    ttl_s: float | int = Field(default=DEFAULT_TTL_S, description=f"seconds the prefix is protected from eviction "
                               f"({MIN_TTL_S:g} to {MAX_TTL_S:g}; default {DEFAULT_TTL_S:g})")


class CachePinRequest(CachePrefix):
    """`POST /v1/cache/pin`: keep the cached part of a prefix in host memory until unpinned."""


class CacheUnpinRequest(CachePrefix):
    """`POST /v1/cache/unpin`: release a prefix's pins, or every pin of the caller (`all`)."""

    all: bool = Field(default=False, description="release every pin and prefetch protection of the caller")


class CacheDeleteRequest(CachePrefix):
    """`DELETE /v1/cache`: drop a prefix's blocks, or every block of the caller (`all`), in every
    tier."""

    all: bool = Field(default=False, description="drop every block of the caller, in every tier")


# ---------------------------------------------------------------- responses


class CacheLookupResponse(BaseModel):
    object: Literal["cache.lookup"] = "cache.lookup"
    prompt_tokens: int = Field(description="tokens of the prompt")
    block_size: int = Field(description="tokens per KV block: only full blocks are cached")
    cached_tokens: int = Field(description="leading prompt tokens a request would now reuse from some tier "
                               "(as its usage.prompt_tokens_details.cached_tokens would say)")
    tiers: dict[str, int] = Field(description="of cached_tokens, the tokens each tier would serve (the first "
                                  "tier holding each block, top down): device, host, disk, remote")
    blocks: dict[str, int] = Field(description="of the prompt's reusable blocks, how many each tier holds, "
                                   "leading or not")


class CachePrefetchResponse(BaseModel):
    object: Literal["cache.prefetch"] = "cache.prefetch"
    prompt_tokens: int
    cached_tokens: int = Field(description="leading prompt tokens now on the device or in host memory")
    loaded_blocks: dict[str, int] = Field(description="blocks brought up into host memory, by the tier they "
                                          "came from (disk, remote)")
    loaded_tokens: int = Field(description="tokens of the blocks brought up")
    protected_blocks: int = Field(description="blocks protected from eviction until expires_at (within the "
                                  "tenant's host quota and the pin budget)")
    ttl_s: float
    expires_at: float = Field(description="Unix time the protection ends; the blocks are ordinary after it")


class CachePinResponse(BaseModel):
    object: Literal["cache.pin"] = "cache.pin"
    pinned_blocks: int = Field(description="the tenant's blocks of the prefix now pinned (0 if not cached)")
    pinned_tokens: int = Field(description="their tokens")
    cached_tokens: int = Field(description="leading prompt tokens on the device or in host memory (a declared "
                               "public prefix's blocks count here but are nobody's to pin)")
    new_pins: int = Field(description="of pinned_blocks, those the tenant had not pinned before")
    tenant_pinned_blocks: int = Field(description="blocks the tenant holds pinned (or prefetch-protected) in all")
    quota: int | None = Field(description="the tenant's host quota in blocks (pins count within it), or null")


class CacheUnpinResponse(BaseModel):
    object: Literal["cache.unpin"] = "cache.unpin"
    unpinned_blocks: int = Field(description="pins (and prefetch protections) released")
    tenant_pinned_blocks: int = Field(description="blocks the tenant still holds pinned")


class CacheDeleteResponse(BaseModel):
    object: Literal["cache.delete"] = "cache.delete"
    dropped: int = Field(description="blocks dropped, all tiers together")
    dropped_blocks: dict[str, int] = Field(description="blocks dropped per tier: device (idle blocks only), "
                                           "host, disk, remote")
    skipped_in_use: int = Field(description="device blocks a running request holds: left in place (they go "
                                "down the tiers when it ends)")
    unpinned_blocks: int = Field(description="the caller's pins and protections released with the blocks")
