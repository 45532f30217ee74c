"""`POST /admin/audit`: run the isolation self-test now; `GET /admin/audit`: the last report
(docs/audit.md). Admin key only.

One audit runs at a time (a second is a 409 while it runs). It runs as a task of its own: a
client that leaves does not stop it halfway, so its cleanup always runs, and `GET` shows the
report once it is done.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from app.audit import DEFAULT_SAMPLES, MAX_SAMPLES, MIN_SAMPLES, AuditError, IsolationAudit
from app.auth import AdminAccess, Engine
from app.errors import ConflictError
from app.protocol import RequestModel
from engine.errors import InvalidRequestError
from tenants.registry import load_server_secret

logger = logging.getLogger(__name__)

router = APIRouter(tags=["admin"])


class AuditRequest(RequestModel):
    """Body of `POST /admin/audit` (optional: every attached tier, the default sample size)."""

    tiers: list[str] | None = Field(default=None, min_length=1, max_length=16,
                                    description="the tiers to audit (device and the attached ones, as "
                                    "GET /admin/tiers names them); default: all of them")
    samples: int = Field(default=DEFAULT_SAMPLES, ge=MIN_SAMPLES, le=MAX_SAMPLES,
                         description=f"TTFT samples per side of each timing check ({MIN_SAMPLES} to "
                         f"{MAX_SAMPLES}; default {DEFAULT_SAMPLES})")


class KSReport(BaseModel):
    d: float = Field(description="the KS statistic: the largest gap between the two TTFT distributions")
    p: float = Field(description="its asymptotic p-value")
    samples: int = Field(description="TTFTs per side")
    median_s: tuple[float, float] = Field(description="median TTFT of each side, seconds")
    runs: int = Field(description="1, or 2 when the first run failed and a second with new prompts decided")
    passed: bool = Field(description="across salts: p > 0.01 (no signal); the control: p < 0.01 (a signal)")


class TierReport(BaseModel):
    passed: bool
    placed_tokens: int = Field(description="tokens of the probe prefix the tier held, and no tier above it")
    expected_tokens: int = Field(description="the probe prefix's full blocks, in tokens")
    same_salt_hit_tokens: int = Field(description="tokens the same salt's request reused (must be expected_tokens)")
    same_salt_via: str = Field(description="request; or prefetch, when the engine predicted recomputing faster "
                               "than loading from this tier, and a cache prefetch (which loads regardless) asked it")
    other_salt_hit_tokens: int = Field(description="tokens another salt's request reused (must be 0)")
    other_salt_lookup_tokens: int = Field(description="tokens the cache API said the other salt would reuse (0)")
    same_salt_counter_deltas: dict[str, int] = Field(description="each tier's hit counter over the same salt's "
                                                     "request (device: blocks reused from the pool)")
    other_salt_counter_deltas: dict[str, int] = Field(description="... over the other salt's request (all 0)")
    quiet: bool = Field(description="no other request ran meanwhile, so the counter deltas were checked")
    ks: KSReport | None = Field(description="TTFT of the other salt on prompts cached in this tier vs on "
                                "fresh prompts")
    failures: list[str] = Field(description="why it failed, one line each")


class AuditReport(BaseModel):
    passed: bool = Field(description="every tier passed, the timing control saw the cache, nothing is left")
    started_at: float = Field(description="Unix time the audit started")
    duration_s: float
    samples: int
    prompt_tokens: int = Field(description="tokens of each synthetic prompt")
    block_size: int
    requests: int = Field(description="engine requests the audit sent (no tenant's: not in any tenant's figures)")
    timing: dict[str, int] = Field(description="timed probes, and of them those that ran while no block write "
                                   "was in flight (calm_probes): the audit waits up to 0.25 s for one")
    tiers: dict[str, TierReport] = Field(description="per tier, top down")
    control: KSReport | None = Field(description="the device's positive control: the same salt's hits vs "
                                     "misses must differ, or the timing checks prove nothing")
    cleanup: dict[str, Any] = Field(description="dropped_blocks per tier, checked_prompts, remaining_tokens "
                                    "(must be 0)")
    error: str | None = Field(description="why the audit stopped early, if it did")


class AuditStatus(BaseModel):
    running: bool = Field(description="an audit is running now")
    last: AuditReport | None = Field(description="the last finished audit's report (null: none since start)")


@router.post("/admin/audit", dependencies=[AdminAccess], response_model=AuditReport)
async def run_audit(request: Request, engine: Engine, body: AuditRequest | None = None) -> AuditReport:
    """Run the isolation self-test now and return its report (about 10–20 s on the tiny model):
    for each tier, a prefix cached under one synthetic salt must be reused by that salt, from
    that tier, and by no other salt, whose time to first token must not show it either. The
    audit's prompts are random token ids in namespaces of its own: no tenant's data is read, and
    its blocks are deleted from every tier when it ends. 409 while another audit runs."""
    state = request.app.state
    if getattr(state, "audit_running", False):
        raise ConflictError("An isolation audit is already running; GET /admin/audit shows its report once done.",
                            code="audit_running")
    state.audit_running = True
    try:
        body = body if body is not None else AuditRequest()
        tiers = await _tiers(engine, body.tiers)
        secret = await asyncio.to_thread(load_server_secret, state.settings.server.secret)
        task = asyncio.ensure_future(IsolationAudit(engine, secret, tiers, body.samples).run())
    except AuditError as exc:  # the served model's context cannot hold the audit's prompts
        state.audit_running = False
        raise ConflictError(f"The isolation audit cannot run on this server: {exc}", code="audit_impossible") from None
    except BaseException:
        state.audit_running = False
        raise
    task.add_done_callback(lambda done: _finished(state, done))  # before the shield's: runs first
    return AuditReport(**await asyncio.shield(task))


@router.get("/admin/audit", dependencies=[AdminAccess], response_model=AuditStatus)
async def last_audit(request: Request) -> AuditStatus:
    """Whether an audit is running, and the last finished one's report (`last: null` before the first)."""
    state = request.app.state
    return AuditStatus(running=bool(getattr(state, "audit_running", False)), last=getattr(state, "audit_last", None))


async def _tiers(engine: Any, asked: list[str] | None) -> list[str]:
    """The tiers to audit, top down: those asked for, which must be attached; default all."""
    attached = ["device", *(name for name in (await engine.stats()).get("tiers") or {} if name != "chain")]
    if asked is None:
        return attached
    unknown = [name for name in asked if name not in attached]
    if unknown:
        raise InvalidRequestError(f"tiers {', '.join(map(repr, unknown))} are not attached; the attached tiers are "
                                  f"{', '.join(attached)}", param="tiers")
    return [name for name in attached if name in asked]


def _finished(state: Any, task: asyncio.Future[dict[str, Any]]) -> None:
    state.audit_running = False
    if task.cancelled() or task.exception() is not None:
        logger.error("isolation audit crashed: %s", "cancelled" if task.cancelled() else task.exception())
        return
    report = task.result()
    state.audit_last = AuditReport(**report)
    logger.log(logging.INFO if report["passed"] else logging.WARNING,
               "isolation audit passed=%s duration_s=%.1f tiers=%s error=%s", report["passed"], report["duration_s"],
               ",".join(f"{name}:{'pass' if t['passed'] else 'FAIL'}" for name, t in report["tiers"].items()),
               report["error"])
