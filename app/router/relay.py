"""The router's state: how a request is scored and where it is relayed (the routes are in
app/router/server.py, the score in app/router/index.py).

Relaying keeps the request as sent (headers, body) and the answer as it comes: SSE chunks pass
unbuffered, a client that leaves closes the upstream request. A replica that cannot be reached or
answers 503 before anything was relayed leaves the rotation and the next cheapest gets the
request; a stream broken off mid-way ends with an OpenAI-style error event and [DONE].
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from app.cache_protocol import CachePrefix
from app.errors import APIError
from app.prompts import PromptPool
from app.protocol import ChatCompletionRequest
from app.public_prefixes import PrefixSpec, PublicPrefixStore
from app.router.index import Estimate, ReplicaIndex, estimate
from app.router.replicas import Replica, Replicas
from app.settings import Settings
from cache.hashing import extend_block_hashes, prompt_roots
from tenants.public import PublicPrefixes
from tenants.registry import Tenant

logger = logging.getLogger(__name__)

# hop-by-hop and framing headers: the router's own connection decides them
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length", "content-encoding"}
DEFAULT_MAX_TOKENS = 256  # the load estimate of a request that names no max_tokens
# what the prefill leg leaves out: it computes the prompt and one token, nothing to stream or score
_PREFILL_DROPS = {"stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs", "echo", "min_tokens",
                  "max_tokens", "max_completion_tokens"}
# prefix: the score (app/router/index.py); round_robin: each healthy replica in turn, blind (the
# baseline the router is measured against, docs/benchmarks.md)
POLICIES = ("prefix", "round_robin")


class NoReplicaError(APIError):
    status_code = 503
    error_type = "service_unavailable"


def _headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP}


class Router:
    """Scores requests and relays them; the state behind the routes."""

    def __init__(self, settings: Settings, replicas: Replicas, tokenizer: Any, load_weight: float = 1.0,
                 policy: str = "prefix") -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.settings = settings
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.load_weight = load_weight
        self.registry = settings.tenant_registry()
        self.prefixes = PublicPrefixStore([PrefixSpec(p.name, p.text, p.system, tuple(p.token_ids) if p.token_ids
                                                      else None) for p in settings.public_prefixes])
        self.public = PublicPrefixes()  # the declared prefixes as token ids, once the tokenizer ran
        self.pool = PromptPool()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.turn = 0
        self.decisions = {"prefix": 0, "load": 0, "unscored": 0, "retried": 0, "disaggregated": 0,
                          "prefill_failed": 0}
        self.predicted_cached_tokens = 0

    # ---- scoring ----------------------------------------------------------------------------------
    async def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The first prompt's token ids as a replica will see them, or None (not scorable)."""
        info = next((r.info for r in self.replicas if r.info), None)
        if info is None:
            return None
        builder = self.pool.builder(self.tokenizer, int(info["max_model_len"]))
        try:
            self.public = await self.prefixes.ready(builder)
            if path.endswith("/chat/completions"):
                chat = ChatCompletionRequest.model_validate(body)
                return await builder.chat(chat.messages)
            if path.startswith("/v1/cache"):
                prefix = CachePrefix.model_validate(body)
                if prefix.messages is not None:
                    return await builder.chat(prefix.messages)
                return (await builder.completion(prefix.prompt))[0] if prefix.prompt is not None else None
            prompts = await builder.completion(body.get("prompt"))
            return prompts[0] if prompts else None
        except (APIError, ValidationError, ValueError, TypeError, KeyError):
            return None
        except Exception as exc:  # the tokenizer's own errors: the replica will say what is wrong
            logger.debug("router: prompt not scorable (%s)", exc)
            return None

    def role_of(self, i: int) -> str:
        return str((self.replicas.replicas[i].info or {}).get("role", "both"))

    def estimates(self, ids: list[int] | None, tenant: Tenant, cache_salt: str | None,
                  max_tokens: int, roles: tuple[str, ...] = ("both", "prefill", "decode")) -> list[Estimate]:
        healthy = [i for i, r in enumerate(self.replicas.replicas) if r.healthy and self.role_of(i) in roles]
        out = []
        hashes_by_fp: dict[tuple[str, int], list[bytes]] = {}
        for i in healthy:
            replica = self.replicas.replicas[i]
            hashes: list[bytes] = []
            block_size = 16
            if ids is not None and replica.info is not None:
                fp, block_size = str(replica.info["fingerprint"]), int(replica.info["block_size"])
                hashes = hashes_by_fp.get((fp, block_size)) or self._hashes(ids, tenant, cache_salt, fp, block_size)
                hashes_by_fp[(fp, block_size)] = hashes
            n = len(ids) if ids is not None else 0
            out.append(estimate(i, replica.index, hashes, n, block_size, replica.outstanding, replica.in_flight,
                                self.load_weight, self._peers(replica)))
        return out

    def _peers(self, replica: Replica) -> list[ReplicaIndex]:
        """The indexes of the replicas writing through to the shared store ``replica`` reads
        (itself included; none where it has no such store)."""
        store = (replica.info or {}).get("shared_store")
        if not store:
            return []
        return [r.index for r in self.replicas.replicas if (r.info or {}).get("shared_store") == store]

    def _hashes(self, ids: list[int], tenant: Tenant, cache_salt: str | None, fp_hex: str,
                block_size: int) -> list[bytes]:
        public = self.public.match(ids) if cache_salt is None and len(self.public) else 0
        root, switch = prompt_roots(tenant.salt, bytes.fromhex(fp_hex), cache_salt, public // block_size,
                                    self.registry.public_salt)
        return extend_block_hashes([], root, ids, block_size, switch)

    # ---- relaying ---------------------------------------------------------------------------------
    async def relay(self, request: Request, body: bytes, order: list[Estimate], prompt_cost: int = 0,
                    generate_cost: int = 0) -> Response:
        """Send the request to the first replica of ``order`` that takes it; ``prompt_cost``: its
        prompt tokens to compute there, ``generate_cost`` the tokens it may generate (its load)."""
        for attempt, choice in enumerate(order):
            replica = self.replicas.replicas[choice.replica]
            upstream = self.client.build_request(request.method, replica.url + request.url.path,
                                                 params=request.query_params, headers=_headers(request.headers),
                                                 content=body)
            try:
                response = await self.client.send(upstream, stream=True)
            except httpx.TransportError as exc:
                replica.errors += 1
                self.replicas.failed(replica, f"request failed: {type(exc).__name__}")
                if attempt + 1 < len(order):
                    self.decisions["retried"] += 1
                continue
            if response.status_code == 503 and attempt + 1 < len(order):  # draining or not ready: untouched
                await response.aclose()
                self.replicas.failed(replica, "answered 503 (draining or not ready)")
                self.decisions["retried"] += 1
                continue
            replica.routed += 1
            load = _Load(replica, prompt_cost, generate_cost)
            # a chat stream's first event (the role) comes before the prompt is computed
            first_answer = 2 if request.url.path.endswith("/chat/completions") else 1
            return StreamingResponse(self._stream(response, load, first_answer), status_code=response.status_code,
                                     headers=_headers(response.headers),
                                     media_type=response.headers.get("content-type"))
        raise NoReplicaError("No replica could take the request (all are down or refused it); retry shortly.",
                             headers={"Retry-After": "1"})

    async def prefill(self, request: Request, body: dict[str, Any], order: list[Estimate],
                      cost: int) -> Response | None:
        """The prefill leg of a disaggregated request: the prompt alone (one token, not streamed) on
        the first prefill replica of ``order`` that takes it, which answers once the prompt's
        blocks are in the shared store. None when it went through (the decode leg follows); a
        replica's 4xx is the client's answer as it is; None too when no prefill replica could
        take it (the decode replica then computes the prompt itself)."""
        leg = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
        leg.update(max_tokens=1, stream=False)
        if "max_completion_tokens" in body:
            leg["max_completion_tokens"] = 1
        for choice in order:
            replica = self.replicas.replicas[choice.replica]
            replica.in_flight += 1
            replica.outstanding += cost
            try:
                response = await self.client.post(replica.url + request.url.path, json=leg,
                                                  headers=_headers(request.headers))
            except httpx.TransportError as exc:
                replica.errors += 1
                self.replicas.failed(replica, f"request failed: {type(exc).__name__}")
                continue
            finally:
                _finish(replica, cost)
            replica.routed += 1
            if response.status_code == 200:
                return None
            if 400 <= response.status_code < 500 and response.status_code != 429:
                return Response(response.content, status_code=response.status_code, headers=_headers(response.headers),
                                media_type=response.headers.get("content-type"))
            self.replicas.failed(replica, f"prefill answered {response.status_code}")
        self.decisions["prefill_failed"] += 1
        logger.warning("router: no prefill replica took a request; its decode replica computes the prompt")
        return None

    async def fan_out(self, request: Request, body: bytes) -> Response:
        """The request to every healthy replica at once (a cache delete, an unpin of everything):
        their answers merged (numbers summed) when all succeed, else the first failure."""
        targets = [r for r in self.replicas if r.healthy]
        if not targets:
            raise NoReplicaError("No replica is in rotation; retry shortly.", headers={"Retry-After": "1"})

        async def one(replica: Replica) -> httpx.Response | None:
            try:
                return await self.client.request(request.method, replica.url + request.url.path,
                                                 params=request.query_params, headers=_headers(request.headers),
                                                 content=body)
            except httpx.TransportError as exc:
                replica.errors += 1
                self.replicas.failed(replica, f"request failed: {type(exc).__name__}")
                return None

        answers = await asyncio.gather(*(one(r) for r in targets))
        failed = next((a for a in answers if a is None or a.status_code != 200), "none")
        if failed is None:
            raise NoReplicaError("A replica could not be reached for a request every replica must see; "
                                 "send it again shortly.", headers={"Retry-After": "1"})
        if isinstance(failed, httpx.Response):
            return Response(failed.content, status_code=failed.status_code, headers=_headers(failed.headers),
                            media_type=failed.headers.get("content-type"))
        merged: dict[str, Any] = {}
        for answer in answers:
            assert answer is not None
            merged = _merge(merged, answer.json())
        merged["replicas"] = len(answers)
        return JSONResponse(merged)

    @staticmethod
    async def _stream(response: httpx.Response, load: _Load, first_answer: int) -> AsyncIterator[bytes]:
        """Relay ``response``; the prompt part of ``load`` ends with the ``first_answer``-th event of
        a stream (any byte of another answer)."""
        sse = response.headers.get("content-type", "").startswith("text/event-stream")
        events = 0
        try:
            async for chunk in response.aiter_raw():
                if load.prompt:
                    events += chunk.count(b"data:") if sse else 1
                    if events >= (first_answer if sse else 1):
                        load.answered()
                yield chunk
        except httpx.TransportError as exc:
            load.replica.broken += 1
            logger.warning("router: a replica broke off a response (%s)", type(exc).__name__)
            if sse:
                error = {"error": {"message": "The replica serving this stream stopped; retry the request.",
                                   "type": "service_unavailable", "param": None, "code": "replica_lost"}}
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            load.end()
            await response.aclose()

    async def close(self) -> None:
        await self.client.aclose()
        self.pool.close()

    def snapshot(self) -> dict[str, Any]:
        return {"policy": self.policy, "load_weight": self.load_weight, "decisions": dict(self.decisions),
                "predicted_cached_tokens": self.predicted_cached_tokens,
                "replicas": [r.snapshot() for r in self.replicas]}


def _merge(a: Any, b: Any) -> Any:
    """Two replicas' answers as one: numbers added, objects merged key by key, else the first."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return a + b
    return a


def _finish(replica: Replica, cost: int) -> None:
    replica.in_flight -= 1
    replica.outstanding -= cost


class _Load:
    """One relayed request's part in its replica's load (``outstanding``): its prompt tokens still
    to compute until the first byte of the answer comes back, its tokens to generate until the
    answer ends (or is cancelled)."""

    def __init__(self, replica: Replica, prompt: int, generate: int) -> None:
        self.replica, self.prompt, self.generate = replica, prompt, generate
        self.ended = False
        replica.in_flight += 1
        replica.outstanding += prompt + generate

    def answered(self) -> None:
        self.replica.outstanding -= self.prompt
        self.prompt = 0

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.replica.outstanding -= self.prompt + self.generate
            self.replica.in_flight -= 1
