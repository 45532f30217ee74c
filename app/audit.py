"""The isolation self-test (`POST /admin/audit`, docs/audit.md): on the running server, through the
engine's own request path, show per attached tier that a prefix cached under one namespace salt
is reused under that salt and under no other, and that its timing says nothing either.

Two synthetic tenants (`AUDIT_TENANT_PREFIX` + a, b: names no configured tenant can have) get
salts derived from the server secret under namespaces made fresh for each run, and send random
token ids, so an audit never meets a tenant's blocks or an earlier audit's. Per tier T::

    A computes P ─▶ place(P, T): P lives in T, in no tier above ─▶ lookup(A, P) = P's blocks in T
    B sends P: must reuse 0 tokens, and (quiet server) move no tier's hit counter
    A sends P: must reuse all of P's blocks, and (quiet server) T's hit counter moves by them
    timing: TTFT of B on A's prompts placed in T vs B on fresh prompts, two-sample KS: p > 0.01
    (once more with new prompts if not), beside the control that A's hits vs A's misses on the
    device do differ (p < 0.01): a check that cannot see a cache proves nothing by its silence

Each timed probe waits for the chain's block writes to end first (`calm`) and its own blocks are
dropped right after it, before the background writer copies them down: writes running beside a
request were the largest noise in its TTFT. The audit's requests go straight to the engine (no
tenant's rate limits, quotas, request counters or traces); at the end every block of both audit
tenants is dropped in every tier (Redis included), and every prompt sent is looked up to show
that none is left.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from app.ks import TimingCheck, timing_check
from engine.async_engine import AsyncEngine
from engine.cache_control import AUDIT_TENANT_PREFIX, CacheCommand
from engine.errors import EngineError, EngineOverloadedError
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from tenants.registry import namespace_salt

logger = logging.getLogger(__name__)

DEFAULT_SAMPLES = 24
MIN_SAMPLES, MAX_SAMPLES = 8, 200
ALPHA = 0.01  # the KS test's level: across salts p must stay above it, the control must fall below
# Full blocks per synthetic prompt (then half a block more, never cached), as far as the context
# allows: 512 tokens of 16-token blocks. Fewer left the timing control blind on a fast small model:
# a hit and a miss of 128 tokens differ by less than the noise of a busy 2-core machine.
PROMPT_BLOCKS = 32
SIDES = ("a", "b")
CALM_S = 0.25  # the longest wait for the chain's writes before a timed probe (then it runs anyway)
CALM_GIVE_UP = 4  # waits in a row that ran out: the chain is busy with tenants' writes, stop waiting
SETTLE_S = 5.0  # how long to wait for a placement to show, or for background writes to end


class AuditError(Exception):
    """The audit could not go on (the engine or a tier refused or failed); it reports failed."""


def audit_salts(secret: bytes, nonce: str) -> tuple[bytes, bytes]:
    """The two salts of one run: the server's tenant salt derivation (`namespace_salt`) applied to
    namespaces no tenant has ("tenant:…", "group:…", "anonymous", "public" are theirs)."""
    return namespace_salt(secret, f"kvgate-audit-a:{nonce}"), namespace_salt(secret, f"kvgate-audit-b:{nonce}")


@dataclass(slots=True)
class TierResult:
    """What the audit found in one tier."""

    passed: bool = False
    placed_tokens: int = 0  # of the probe prefix, tokens the tier held (and no tier above)
    expected_tokens: int = 0  # the probe prefix's full blocks, in tokens
    same_salt_hit_tokens: int = 0
    same_salt_via: str = "request"  # or "prefetch", when the engine chose to recompute rather than load
    other_salt_hit_tokens: int = 0
    other_salt_lookup_tokens: int = 0  # what the cache API said the other salt would reuse
    same_salt_counter_deltas: dict[str, int] = field(default_factory=dict)  # tier hit counters over A's probe
    other_salt_counter_deltas: dict[str, int] = field(default_factory=dict)  # ... over B's probe
    quiet: bool = True  # no other request ran during the probes: the counter deltas are the audit's alone
    ks: TimingCheck | None = None
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Counters:
    """What the probes compare: requests and tenants' cache prefetches the engine accepted (the
    audit's own commands are not counted there), each tier's hit counter (device: blocks reused
    from the pool), and how often the chain chose to recompute a prefix rather than load it."""

    work: int
    hits: dict[str, int]
    recomputed: int

    def deltas(self, before: Counters) -> dict[str, int]:
        return {name: n - before.hits.get(name, 0) for name, n in self.hits.items()}


class IsolationAudit:
    """One run of the audit against one engine (`run` returns the report as plain values)."""

    def __init__(self, engine: AsyncEngine, secret: bytes, tiers: list[str], samples: int = DEFAULT_SAMPLES,
                 seed: int | None = None) -> None:
        self.engine = engine
        self.tiers = tiers
        self.samples = samples
        self.nonce = secrets.token_hex(8)
        self.salts = dict(zip(SIDES, audit_salts(secret, self.nonce), strict=True))
        self.tenants = {side: AUDIT_TENANT_PREFIX + side for side in SIDES}
        self.rng = random.Random(seed if seed is not None else secrets.randbits(64))
        limits = engine.limits
        self.block_size = limits.block_size
        self.blocks = min(PROMPT_BLOCKS, (limits.max_model_len - 2) // self.block_size - 1)
        if self.blocks < 1:
            raise AuditError(f"the context ({limits.max_model_len} tokens) holds no two blocks of {self.block_size}")
        self.vocab = limits.vocab_size
        self.sent: set[tuple[str, tuple[int, ...]]] = set()  # every (side, prompt) the engine saw: cleanup checks them
        self.requests = 0
        self.probes = self.calm_probes = self.vain = 0  # timed probes; those on a calm chain (`calm`)

    # ---- the engine's own paths -----------------------------------------------------------------
    def prompt(self) -> list[int]:
        size = self.blocks * self.block_size + max(1, self.block_size // 2)
        return [self.rng.randrange(3, self.vocab) for _ in range(size)]

    async def send(self, side: str, ids: list[int]) -> tuple[float, int]:
        """One request of one token, as a completion route sends it: (TTFT in s, cached tokens)."""
        self.requests += 1
        request = GenerateRequest(request_id=f"kvgate-audit-{self.nonce}-{self.requests}", prompt_token_ids=ids,
                                  params=SamplingParams(max_tokens=1, temperature=0.0),
                                  namespace_salt=self.salts[side], tenant=self.tenants[side])
        self.sent.add((side, tuple(ids)))
        deadline = time.monotonic() + SETTLE_S
        while True:
            started = time.perf_counter()
            try:
                stream = self.engine.add_request(request)
                break
            except EngineOverloadedError:  # the queue is full of tenants' work: they go first
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        first: float | None = None
        cached = 0
        try:
            async for out in stream:
                if first is None:
                    first = time.perf_counter() - started
                cached = out.metrics.cached_tokens
        finally:
            self.engine.abort(request.request_id)
        if first is None:
            raise AuditError("an audit request ended without a token")
        return first, cached

    async def control(self, op: str, side: str, ids: list[int] | None, tier: str | None = None) -> dict[str, Any]:
        """One cache control command in the audit's namespace; its answer (AuditError if refused)."""
        command = CacheCommand(op=op, tenant=self.tenants[side], namespace_salt=self.salts[side],
                               prompt_token_ids=tuple(ids) if ids is not None else None, tier=tier, ttl_s=1.0)
        answer = await self.engine.cache_control(command)
        if not answer.get("ok"):
            raise AuditError(f"{op} in the audit namespace was refused: {answer.get('message')}")
        return answer

    async def counters(self) -> Counters:
        """The engine's counters the probes compare before and after (`Counters`)."""
        stats = await self.engine.stats()
        tiers = stats.get("tiers") or {}
        prefetches = ((stats.get("cache_control") or {}).get("requests") or {}).get("prefetch", 0)
        hits = {"device": int((stats.get("prefix_cache") or {}).get("block_hits", 0))}
        hits.update({name: int(entry.get("hits", 0)) for name, entry in tiers.items() if name != "chain"})
        return Counters(work=int(stats.get("requests_added", 0)) + int(prefetches), hits=hits,
                        recomputed=int((tiers.get("chain") or {}).get("recompute_chosen", 0)))

    async def writes_done(self, limit_s: float) -> bool:
        """Wait (at most ``limit_s``) until no block write is in flight or waiting in the chain."""
        deadline = time.monotonic() + limit_s
        while True:
            chain = ((await self.engine.stats()).get("tiers") or {}).get("chain") or {}
            if not chain.get("pending_writes") and not chain.get("unpersisted_blocks"):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.002)

    async def calm(self) -> None:
        """Before a timed probe: wait (at most CALM_S) for the chain's writes, which slow whatever
        request runs beside them and would bury a hit's signal in noise. On a chain that tenants'
        traffic keeps busy, stop waiting after CALM_GIVE_UP waits in vain."""
        self.probes += 1
        if self.vain >= CALM_GIVE_UP:
            return
        if await self.writes_done(CALM_S):
            self.calm_probes += 1
            self.vain = 0
        else:
            self.vain += 1

    async def purge(self) -> dict[str, int]:
        """Drop every block of both audit tenants in every tier; blocks dropped per tier."""
        dropped: dict[str, int] = {}
        for side in SIDES:
            for name, n in (await self.control("delete", side, None))["dropped_blocks"].items():
                dropped[name] = dropped.get(name, 0) + n
        return dropped

    # ---- the checks -------------------------------------------------------------------------------
    async def place(self, ids: list[int], tier: str) -> int:
        """Put A's prefix ``ids`` in ``tier`` only; the tokens the cache API then finds there."""
        await self.control("place", "a", ids, tier)
        want = self.blocks * self.block_size
        deadline = time.monotonic() + SETTLE_S
        while True:  # a block whose disk write is in flight shows as host a moment longer
            found = await self.control("lookup", "a", ids)
            held = int(found["tiers"].get(tier, 0))
            if found["cached_tokens"] != held:  # some of it is served from a tier above
                held = 0
            if held == want or time.monotonic() > deadline:
                return held
            await asyncio.sleep(0.02)

    async def probe(self, tier: str) -> TierResult:
        """The exact part: where the prefix is, and who reuses it."""
        want = self.blocks * self.block_size
        result = TierResult(expected_tokens=want)
        ids = self.prompt()
        await self.send("a", ids)
        result.placed_tokens = await self.place(ids, tier)
        result.other_salt_lookup_tokens = int((await self.control("lookup", "b", ids))["cached_tokens"])
        before = await self.counters()
        # Ask the tier as a prefetch does first: it loads whatever the tier hands B regardless of
        # the cost model, so a leak shows even where the request alone would have recomputed.
        await self.control("prefetch", "b", ids)
        _, result.other_salt_hit_tokens = await self.send("b", ids)
        start = await self.counters()
        result.other_salt_counter_deltas = start.deltas(before)
        quiet = start.work - before.work == 1  # the audit's own request alone
        _, result.same_salt_hit_tokens = await self.send("a", ids)
        after = await self.counters()
        if result.same_salt_hit_tokens != want and after.recomputed > start.recomputed:
            # The engine predicted recomputing faster than loading from the tier, so the request never
            # asked it. A cache prefetch loads regardless: the tier must hand it the same salt's blocks,
            # and the request that follows reuses them.
            result.same_salt_via = "prefetch"
            await self.place(ids, tier)
            start = await self.counters()
            await self.control("prefetch", "a", ids)
            _, result.same_salt_hit_tokens = await self.send("a", ids)
            after = await self.counters()
        result.same_salt_counter_deltas = after.deltas(start)
        result.quiet = quiet and after.work - start.work == 1
        fail = result.failures
        if result.placed_tokens != want:
            fail.append(f"the probe prefix could not be placed in {tier} alone ({result.placed_tokens} of {want} tokens)")
        if result.other_salt_lookup_tokens or result.other_salt_hit_tokens:
            fail.append(f"another salt reused {result.other_salt_hit_tokens} tokens (lookup said "
                        f"{result.other_salt_lookup_tokens}) of a prefix cached under the first")
        if result.quiet and any(result.other_salt_counter_deltas.values()):
            fail.append(f"another salt's request moved hit counters: {result.other_salt_counter_deltas}")
        if result.same_salt_hit_tokens != want:
            fail.append(f"the same salt reused {result.same_salt_hit_tokens} of {want} tokens: the tier did not serve it")
        elif result.quiet and result.same_salt_counter_deltas.get(tier, 0) != self.blocks:
            fail.append(f"the same salt's hit was not counted in {tier}: {result.same_salt_counter_deltas}")
        await self.purge()
        return result

    async def timing(self, tier: str, with_control: bool) -> tuple[dict[str, list[float]], bool]:
        """TTFT samples: B on A's prompts placed in ``tier`` vs B on fresh ones (and, with the
        control, A's hits vs A's misses); whether every prompt was placed."""
        sides: dict[str, list[float]] = {"on_cached": [], "fresh": [], "hit": [], "miss": []}
        placed = True
        for _ in range(self.samples):
            ids = self.prompt()
            await self.send("a", ids)
            placed &= (await self.control("place", "a", ids, tier))["placed_blocks"] == self.blocks
            probes = [("on_cached", "b", ids), ("fresh", "b", self.prompt())]
            if with_control:
                probes += [("hit", "a", ids), ("miss", "a", self.prompt())]
            self.rng.shuffle(probes)  # drift on a busy machine falls on every side alike
            for name, side, prompt in probes:
                await self.calm()
                sides[name].append((await self.send(side, prompt))[0])
                if name != "hit":  # what a probe computed goes at once, before it is written down the tiers
                    await self.control("delete", side, prompt)
            await self.control("delete", "a", ids)  # (what slipped through: `cleanup` drops and checks it)
        return sides, placed

    async def audit_tier(self, tier: str, with_control: bool) -> tuple[TierResult, TimingCheck | None]:
        """The exact probe, then the timing check (and the device's control); a check that failed
        runs once more with new prompts: under no leak p < ALPHA happens 1 % of the time."""
        result = await self.probe(tier)
        ks: TimingCheck | None = None
        control: TimingCheck | None = None
        for run in (1, 2):
            redo_ks = ks is None or not ks.passed
            redo_control = with_control and (control is None or not control.passed)
            if not (redo_ks or redo_control):
                break
            sides, placed = await self.timing(tier, redo_control)
            if not placed:
                result.failures.append(f"a timing prompt could not be placed in {tier} alone")
            if redo_ks:
                ks = timing_check(sides["on_cached"], sides["fresh"], False, ALPHA, run)
            if redo_control:
                control = timing_check(sides["hit"], sides["miss"], True, ALPHA, run)
        assert ks is not None
        result.ks = ks
        if not ks.passed:
            result.failures.append(f"another salt can time the cache: KS p={ks.p:.3g} in both runs")
        result.passed = not result.failures
        return result, control

    # ---- the whole run ------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        started_at, t0 = time.time(), time.perf_counter()
        tiers: dict[str, TierResult] = {}
        control: TimingCheck | None = None
        error: str | None = None
        cleanup: dict[str, Any] = {}
        try:
            for tier in self.tiers:
                tiers[tier], found = await self.audit_tier(tier, with_control=tier == "device")
                control = found or control
            if control is None:  # the device was not asked for: its control runs alone
                sides, _ = await self.timing("device", with_control=True)
                control = timing_check(sides["hit"], sides["miss"], True, ALPHA)
        except (AuditError, EngineError, asyncio.TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            logger.warning("isolation audit stopped: %s", error)
        finally:
            cleanup = await self.cleanup()
        passed = (error is None and bool(tiers) and all(t.passed for t in tiers.values())
                  and control is not None and control.passed and cleanup.get("remaining_tokens") == 0)
        return {"passed": passed, "started_at": started_at, "duration_s": round(time.perf_counter() - t0, 3),
                "samples": self.samples, "prompt_tokens": self.blocks * self.block_size + max(1, self.block_size // 2),
                "block_size": self.block_size, "requests": self.requests,
                "timing": {"probes": self.probes, "calm_probes": self.calm_probes},
                "tiers": {name: asdict(t) for name, t in tiers.items()},
                "control": asdict(control) if control is not None else None, "cleanup": cleanup, "error": error}

    async def cleanup(self) -> dict[str, Any]:
        """Wait for background writes, drop both tenants' blocks everywhere, wait for the writes
        that raced the drop, then look up every prompt sent: none may have a block left in any
        tier (one more exact delete, which waits for a write in flight, if one has)."""
        try:
            await self.writes_done(SETTLE_S)
            dropped = await self.purge()
            await self.writes_done(SETTLE_S)
            left = [(side, ids) for side, ids in self.sent if await self.held(side, ids)]
            for side, ids in left:
                await self.control("delete", side, list(ids))
            remaining = sum([await self.held(side, ids) for side, ids in left])
            return {"dropped_blocks": dropped, "checked_prompts": len(self.sent), "remaining_tokens": remaining}
        except (AuditError, EngineError, asyncio.TimeoutError) as exc:
            logger.warning("isolation audit cleanup failed: %s", exc)
            return {"error": f"{type(exc).__name__}: {exc}", "remaining_tokens": None}

    async def held(self, side: str, ids: tuple[int, ...]) -> int:
        """Tokens of a prompt's blocks that any tier holds in ``side``'s namespace."""
        found = await self.control("lookup", side, list(ids))
        return sum(found["blocks"].values()) * self.block_size
