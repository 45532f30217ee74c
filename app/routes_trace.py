"""`GET /admin/trace`: the recent requests as Mooncake trace JSON lines (see `app.trace`).

Each line is a plain record of the public layout (`timestamp` ms from the first request,
`input_length`, `output_length`, `hash_ids`), so AIPerf, guidellm or Dynamo's data generator read
the body unchanged. Hash ids are per 512-token block by default; `block_tokens` picks another
multiple of the trace's granularity (the server's KV block size replays the cache's sharing
exactly). The block size used is in the `X-KVGate-Block-Tokens` header, since the layout has no
place for it.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Request, Response

from app.auth import AdminAccess
from app.errors import APIError
from app.trace import MOONCAKE_BLOCK_TOKENS, export_lines, trace_ring

router = APIRouter(tags=["admin"])

NDJSON = "application/x-ndjson"


@router.get("/admin/trace", dependencies=[AdminAccess], response_class=Response,
            responses={200: {"content": {NDJSON: {}}, "description": "Mooncake trace JSON lines"}})
async def trace(request: Request,
                limit: int | None = Query(default=None, ge=1, description="only the last N requests"),
                block_tokens: int = Query(default=MOONCAKE_BLOCK_TOKENS, description="tokens per hash id "
                                          "(default 512, Mooncake's; the KV block size replays exactly)"),
                ) -> Response:
    """The trace ring's requests in arrival order, one Mooncake JSON record per line.

    No token, text, tenant name, key or salt leaves the server: hash ids are renumbered from 0 in
    order of first appearance in this export, equal ids meaning the same prefix up to that block
    within one tenant's cache namespace.
    """
    ring = trace_ring(request.app)
    problem = ring.check_block_tokens(block_tokens)
    if problem is not None:
        raise APIError(problem, param="block_tokens")
    records = ring.snapshot(limit)
    lines = await asyncio.to_thread(export_lines, records, ring.granularity, block_tokens)
    body = "".join(line + "\n" for line in lines)
    return Response(body, media_type=NDJSON, headers={
        "X-KVGate-Block-Tokens": str(block_tokens), "X-KVGate-Trace-Records": str(len(lines)),
        "X-KVGate-KV-Block-Size": str(ring.block_size)})
