"""The cache control API: `POST /v1/cache/lookup`, `/prefetch`, `/pin`, `/unpin` and
`DELETE /v1/cache` (docs/cache_api.md).

Each call acts in the caller's own namespace: a tenant's key acts for that tenant (its salt, its
quota), the admin key for the tenant it names in `tenant`. The prefix is tokenized exactly as the
completion routes tokenize a prompt (text, token ids, or chat messages through the chat template,
off the event loop) and matched against the declared public prefixes as `_submit` does, so the
engine hashes it into the very blocks a request of that tenant would use. The engine answers
between two steps (`AsyncEngine.cache_control`); disk and Redis work runs on its tiers' I/O
thread, and this handler waits for it, bounded by a timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request

from app.auth import Engine, bearer_token
from app.cache_protocol import (
    MAX_TTL_S,
    MIN_TTL_S,
    CacheDeleteRequest,
    CacheDeleteResponse,
    CacheLookupRequest,
    CacheLookupResponse,
    CachePinRequest,
    CachePinResponse,
    CachePrefetchRequest,
    CachePrefetchResponse,
    CachePrefix,
    CacheUnpinRequest,
    CacheUnpinResponse,
)
from app.errors import (
    APIError,
    AuthenticationError,
    ConflictError,
    GatewayTimeoutError,
    ModelNotFoundError,
    PermissionDeniedError,
)
from app.prompts import builder_of
from app.protocol import MAX_MESSAGES
from engine.async_engine import AsyncEngine
from engine.cache_control import CacheCommand
from engine.errors import InvalidRequestError, PromptTooLongError
from tenants.registry import Tenant

router = APIRouter(prefix="/v1", tags=["cache"])


@router.post("/cache/lookup", response_model=CacheLookupResponse)
async def lookup(body: CacheLookupRequest, request: Request, engine: Engine) -> CacheLookupResponse:
    """How many leading tokens of a prompt are cached, and in which tier (device, host, disk,
    remote). Nothing is computed, scheduled or loaded. Another tenant's prompt, like any prompt
    never sent, answers 0."""
    return CacheLookupResponse(**await _run("lookup", body, request, engine))


@router.post("/cache/prefetch", response_model=CachePrefetchResponse)
async def prefetch(body: CachePrefetchRequest, request: Request, engine: Engine) -> CachePrefetchResponse:
    """Bring a prefix up from disk or Redis into host memory now (off the step loop), so that the
    request that follows starts from it, and protect it from eviction for `ttl_s` seconds
    (1 to 3600, default 300); after that its blocks are ordinary. The answer says how many blocks
    came up and from which tier."""
    ttl = body.ttl_s
    if not MIN_TTL_S <= ttl <= MAX_TTL_S:
        raise InvalidRequestError(f"ttl_s must be between {MIN_TTL_S:g} and {MAX_TTL_S:g} seconds, got {ttl!r}; "
                                  "prefetch again before it runs out, or pin the prefix (POST /v1/cache/pin)",
                                  param="ttl_s")
    return CachePrefetchResponse(**await _run("prefetch", body, request, engine, ttl_s=float(ttl)))


@router.post("/cache/pin", response_model=CachePinResponse)
async def pin(body: CachePinRequest, request: Request, engine: Engine) -> CachePinResponse:
    """Keep the cached part of a prefix (its leading blocks on the device or in host memory) in
    host memory until unpinned: neither other tenants' traffic nor the caller's own unpinned
    traffic evicts it, and the disk tier keeps its copies too. Pins count within the tenant's host
    quota; one past it, or past the pin budget (3/4 of the host tier), is a 409 naming the quota
    and what is pinned now. A prefix that is not cached pins nothing (`pinned_blocks: 0`): send
    the request, or prefetch it, first."""
    return CachePinResponse(**await _run("pin", body, request, engine))


@router.post("/cache/unpin", response_model=CacheUnpinResponse)
async def unpin(body: CacheUnpinRequest, request: Request, engine: Engine) -> CacheUnpinResponse:
    """Release the caller's pins (and prefetch protections) of a prefix, or all of them with
    `{"all": true}`; the blocks stay cached as ordinary ones."""
    return CacheUnpinResponse(**await _run("unpin", body, request, engine, everything=body.all))


@router.delete("/cache", response_model=CacheDeleteResponse)
async def delete(request: Request, engine: Engine, body: CacheDeleteRequest | None = None,
                 all_: bool = Query(False, alias="all", description="drop every block of the caller")
                 ) -> CacheDeleteResponse:
    """Drop the caller's blocks of a prefix (`prompt` or `messages`), or all of them
    (`{"all": true}` or `?all=true`), from every tier: idle device blocks, host memory, disk files
    and Redis. Device blocks a running request holds are left (`skipped_in_use`); the next request
    with the prefix recomputes it."""
    body = body if body is not None else CacheDeleteRequest()
    return CacheDeleteResponse(**await _run("delete", body, request, engine, everything=body.all or all_))


# ------------------------------------------------------------------ helpers


def caller(request: Request, name: str | None) -> Tenant:
    """The tenant a call acts for: the key's own, or (admin key only) the one named in `tenant`."""
    registry = request.app.state.registry
    token = bearer_token(request)
    if name is not None:
        if not registry.is_admin(token):
            if registry.authenticate(token) is None:
                raise AuthenticationError("Incorrect API key provided." if token else
                                          "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
            raise PermissionDeniedError("Only the admin key may act for a tenant: leave out 'tenant' to act for "
                                        "the tenant of your key.", param="tenant", code="permission_denied")
        tenant = registry.get(name)
        if tenant is None:
            raise InvalidRequestError(f"There is no tenant named {name!r}; name one of the configured [[tenants]].",
                                      param="tenant")
    else:
        tenant = registry.authenticate(token)
        if tenant is None:
            if token and registry.is_admin(token):
                raise InvalidRequestError("The admin key acts for a tenant it names: add \"tenant\": \"<name>\" "
                                          "to the body.", param="tenant")
            raise AuthenticationError("Incorrect API key provided." if token else
                                      "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
    request.state.tenant = tenant.name
    return tenant


async def prefix_tokens(request: Request, engine: AsyncEngine, body: CachePrefix) -> list[int]:
    """The prefix's token ids, tokenized as the completion routes would (bounded before any work)."""
    if body.prompt is not None and body.messages is not None:
        raise InvalidRequestError("Give the prefix as prompt or as messages, not both.", param="messages")
    if body.prompt is None and body.messages is None:
        raise InvalidRequestError("Name the prefix with prompt (text or token ids) or messages (a chat); to act on "
                                  "every block of yours, send {\"all\": true} (unpin, delete).", param="prompt")
    builder = builder_of(request.app.state, engine)
    if body.messages is not None:
        if not body.messages:
            raise InvalidRequestError("messages must not be empty.", param="messages")
        if len(body.messages) > MAX_MESSAGES:
            raise InvalidRequestError(f"At most {MAX_MESSAGES} messages, got {len(body.messages)}.", param="messages")
        ids, param = await builder.chat(body.messages), "messages"
    else:
        ids, param = (await builder.completion(body.prompt))[0], "prompt"
    if len(ids) >= engine.max_model_len:
        raise PromptTooLongError(f"This model's maximum context length is {engine.max_model_len} tokens, and the "
                                 f"{param} has {len(ids)}; no request could send it. Please shorten it.", param=param)
    vocab = engine.limits.vocab_size
    if any(isinstance(t, bool) or not 0 <= t < vocab for t in ids):
        raise InvalidRequestError(f"Prompt token ids must be integers in [0, {vocab}).", param="prompt")
    return ids


async def _run(op: str, body: CachePrefix, request: Request, engine: AsyncEngine, ttl_s: float = 300.0,
               everything: bool = False) -> dict[str, Any]:
    """Check, tokenize and hand one operation to the engine; its answer without ``ok``."""
    tenant = caller(request, body.tenant)
    if body.model is not None and body.model != engine.model_name:
        raise ModelNotFoundError(body.model)
    if body.cache_salt is not None and not body.cache_salt:
        raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
    ids: list[int] | None = None
    public_len = 0
    state = request.app.state
    if everything:
        if body.prompt is not None or body.messages is not None:
            raise InvalidRequestError("Send either a prefix (prompt or messages) or all, not both.", param="all")
    else:
        ids = await prefix_tokens(request, engine, body)
        public = await state.public_prefixes.ready(builder_of(state, engine))
        public_len = public.match(ids) if body.cache_salt is None and len(public) else 0
    command = CacheCommand(op=op, tenant=tenant.name, namespace_salt=tenant.salt,
                           prompt_token_ids=tuple(ids) if ids is not None else None, cache_salt=body.cache_salt,
                           public_prefix_len=public_len, public_salt=state.registry.public_salt,
                           quota=dict(tenant.quota), ttl_s=ttl_s)
    try:
        answer = await engine.cache_control(command)
    except asyncio.TimeoutError:
        raise GatewayTimeoutError("The engine and its cache tiers did not answer in time; retry shortly.",
                                  code="timeout") from None
    if not answer.pop("ok", False):
        raise _refused(answer)
    return answer


def _refused(answer: dict[str, Any]) -> APIError:
    """The engine's refusal as the OpenAI error of its status."""
    status = int(answer.get("status", 500))
    message, param, code = str(answer.get("message", "refused")), answer.get("param"), answer.get("code")
    if status == 409:
        return ConflictError(message, param=param, code=code)
    error = APIError(message, param=param, code=code)
    error.status_code = status
    error.error_type = {400: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")
    return error
