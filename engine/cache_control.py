"""The cache control API inside the engine: look up, prefetch, pin, unpin and drop a tenant's
cached prefixes (`POST /v1/cache/*`, `DELETE /v1/cache`; docs/cache_api.md), and place an
isolation audit's own prefix in one tier (`place`, audit tenants only; docs/audit.md).

    API process                        engine thread, between steps          chain's I/O thread
    AsyncEngine.cache_control(cmd) ──▶ ("cache", token, cmd) ─▶ CacheControl.run
                                       hash as a request would; index
                                       lookups, device and host drops, pins ─▶ Redis EXISTS / DEL,
                                                                                disk unlinks
    ◀── ("reply", token, answer): at once, or from the I/O thread when its part ends; a prefetch
        is the chain's own job, answered when `EngineCore.poll_loads` sees it finish

A command names its tenant's salt, `cache_salt` and public prefix exactly as a request does, so
its block hashes are the ones a request of that tenant would use: another tenant's prompt hashes
to blocks no tier holds, and every answer about it is the answer about an unknown prompt. Pins
and prefetch protections live in one `PinBook` that the host and disk tiers consult when they
evict. Answers are plain dicts: ``{"ok": True, ...}``, or ``{"ok": False, "status", "message",
"code", "param"}`` for the HTTP layer to turn into an OpenAI error.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cache.hashing import BlockHash, extend_block_hashes
from cache.quota import PUBLIC
from cache.tiers.control import (
    PinBook,
    Presence,
    attach_book,
    drop_local,
    drop_stores,
    may_land,
    presence,
    settle_shared,
    settle_writes,
)
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence as Seq
from engine.snapshot import CacheControlSnapshot
from engine.tenancy import owner_tag

if TYPE_CHECKING:
    from engine.core import EngineCore

logger = logging.getLogger(__name__)

OPS = ("lookup", "prefetch", "pin", "unpin", "delete")
AUDIT_OPS = ("place",)  # only for audit tenants (`is_audit_tenant`), never counted with the API's calls
# The isolation audit (app/audit.py) runs as tenants named with this prefix: a configured tenant's
# name has no colon (tenants.registry), so none can be one, and no HTTP key ever resolves to one.
AUDIT_TENANT_PREFIX = "kvgate:audit:"
# Pins and prefetch protections together may hold at most this share of the host tier: the rest
# is where demotions and loads land (a host tier all pinned would pass every block through).
PIN_SHARE = 0.75
TOKEN_PREFIX = "kvgate-cache-prefetch-"  # a prefetch's job in the chain; never a request id the app makes

Reply = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, slots=True)
class CacheCommand:
    """One control operation of one tenant, as plain values (it crosses the process boundary).

    ``prompt_token_ids`` None means every block of the tenant (unpin, delete). The salts and the
    public prefix are the fields of `GenerateRequest` that decide a prompt's block hashes."""

    op: str
    tenant: str
    namespace_salt: bytes
    prompt_token_ids: tuple[int, ...] | None
    cache_salt: str | None = None
    public_prefix_len: int = 0
    public_salt: bytes = b""
    quota: Mapping[str, int] = field(default_factory=dict)
    ttl_s: float = 300.0
    tier: str | None = None  # `place` only: the tier the prefix is to live in

    def __post_init__(self) -> None:
        if self.op not in OPS + AUDIT_OPS:
            raise ValueError(f"op must be one of {', '.join(OPS + AUDIT_OPS)}, got {self.op!r}")
        if (self.op == "place") != (self.tier is not None):
            raise ValueError("tier is given with op 'place', and only then")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty (None: every block of the tenant)")
        if not 0 < self.ttl_s < math.inf:
            raise ValueError(f"ttl_s must be a positive number of seconds, got {self.ttl_s!r}")


def is_audit_tenant(tenant: str) -> bool:
    """Whether ``tenant`` is one of the isolation audit's synthetic tenants."""
    return tenant.startswith(AUDIT_TENANT_PREFIX)


def refusal(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"ok": False, "status": status, "message": message, "code": code, "param": param}


@dataclass(slots=True)
class _Prefetch:
    """A prefetch whose blocks are being read (the chain's job ``token``)."""

    command: CacheCommand
    keys: list[BlockHash]
    own_from: int  # keys before this index are a public prefix's (not the tenant's to protect)
    before: Presence
    reply: Reply


@dataclass(slots=True)
class CacheControlCounters:
    """What the control API did since start (they only grow)."""

    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    prefetched_blocks: dict[str, int] = field(default_factory=dict)  # by the tier they came from
    dropped_blocks: dict[str, int] = field(default_factory=dict)  # by tier
    skipped_in_use: int = 0  # device blocks a delete left to running requests


class CacheControl:
    """Runs `CacheCommand`s for one `EngineCore`, on its thread; owns the pins."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.book = PinBook()
        self.counters = CacheControlCounters()
        self._prefetches: dict[str, _Prefetch] = {}
        self._tokens = itertools.count()
        self._counting = threading.Lock()  # a delete's counts are added on the I/O thread
        self._tags: dict[tuple[str, bytes], str] = {}

    # ---- the engine's hooks -------------------------------------------------------------------
    @property
    def waiting(self) -> bool:
        """Whether a prefetch is reading blocks (the loop then polls often)."""
        return bool(self._prefetches)

    @staticmethod
    def owns(token: str) -> bool:
        return token.startswith(TOKEN_PREFIX)

    def tick(self, now: float | None = None) -> None:
        """Every loop turn: protections past their time become ordinary blocks."""
        if self.book.expiring:
            self.book.expire(time.monotonic() if now is None else now)

    def note_request(self, tenant: str, salt: bytes) -> None:
        """A request of ``tenant``: the shared tier accounts its writes (so `delete` finds them)."""
        chain = self.core.chain
        shared = chain.shared if chain is not None else None
        if shared is None or not tenant or tenant == PUBLIC or not hasattr(shared, "track_owner"):
            return
        if is_audit_tenant(tenant) and hasattr(shared, "set_account"):
            # an audit tenant's salt is new every run: its Redis account follows it, so that the
            # audit's deletes (by prefix or all) find what this run wrote
            shared.set_account(tenant, self._tag(tenant, salt), None)
        shared.track_owner(tenant, self._tag(tenant, salt))

    def _tag(self, tenant: str, salt: bytes) -> str:
        tag = self._tags.get((tenant, salt))
        if tag is None:
            if len(self._tags) > 4096:
                self._tags.clear()
            tag = self._tags[(tenant, salt)] = owner_tag(tenant, salt)
        return tag

    def run(self, command: CacheCommand, reply: Reply) -> None:
        """Carry out ``command``; ``reply`` gets the answer now or, after tier I/O, from the I/O
        thread (or from the loop's `finished`, for a prefetch)."""
        if command.op in self.counters.requests and not is_audit_tenant(command.tenant):  # the API's calls only
            self.counters.requests[command.op] += 1
        core = self.core
        core.tiers.set_quota(command.tenant, command.quota, command.namespace_salt)
        attach_book(core.chain, self.book)
        ids = command.prompt_token_ids
        if ids is not None and not all(0 <= t < core.vocab_size for t in ids):
            reply(refusal(400, f"prompt token ids must be integers in [0, {core.vocab_size})", "invalid_value",
                          "prompt"))
            return
        getattr(self, "_" + command.op)(command, reply)

    # ---- hashing, as a request of that tenant would ---------------------------------------------
    def _hashes(self, command: CacheCommand) -> tuple[list[BlockHash], int]:
        """The command's prompt's full-block hashes, and how many lead with a public prefix."""
        assert command.prompt_token_ids is not None
        root, switch = self.core.roots(command.namespace_salt, command.cache_salt, command.public_prefix_len,
                                       command.public_salt)
        hashes = extend_block_hashes([], root, command.prompt_token_ids, self.core.block_size, switch)
        return hashes, switch[0] if switch is not None else 0

    def _on_device(self, key: bytes) -> bool:
        return self.core.manager.pool.get_cached_block(key) is not None

    def _presence(self, keys: Sequence[bytes]) -> Presence:
        return presence(self.core.chain, keys, self._on_device)

    def _submit(self, coro: Any, reply: Reply) -> None:
        """Run ``coro`` (returning the answer) on the chain's I/O loop; reply when it ends."""
        chain = self.core.chain
        assert chain is not None and chain.io is not None

        async def job() -> None:
            try:
                answer = await coro
            except Exception as exc:
                logger.exception("cache control I/O failed")
                answer = refusal(503, f"the cache tiers failed to answer ({type(exc).__name__}: {exc}); retry",
                                 "tier_error")
            reply(answer)

        chain.io.submit(job())

    # ---- the operations -------------------------------------------------------------------------
    def _lookup(self, command: CacheCommand, reply: Reply) -> None:
        assert command.prompt_token_ids is not None
        hashes, _ = self._hashes(command)
        keys = list(self.core.manager.reusable_hashes(hashes, len(command.prompt_token_ids)))
        found = self._presence(keys)
        chain = self.core.chain
        shared = chain.shared if chain is not None else None
        answer = self._lookup_answer(command, found)
        if shared is None or chain is None or chain.io is None or not keys:
            if shared is not None:
                answer["tiers"][shared.name] = answer["blocks"][shared.name] = 0
            reply(answer)
            return

        async def ask() -> dict[str, Any]:
            found.add_remote(shared.name, await shared.exists(keys))
            return self._lookup_answer(command, found)

        self._submit(ask(), reply)

    def _lookup_answer(self, command: CacheCommand, found: Presence) -> dict[str, Any]:
        assert command.prompt_token_ids is not None
        size = self.core.block_size
        return {"ok": True, "prompt_tokens": len(command.prompt_token_ids), "block_size": size,
                "cached_tokens": found.leading() * size,
                "tiers": {name: n * size for name, n in found.by_tier().items()}, "blocks": found.blocks()}

    def _delete(self, command: CacheCommand, reply: Reply) -> None:
        core, tenant = self.core, command.tenant
        chain = core.chain
        pool = core.manager.pool
        memory = chain.memory if chain is not None else None
        stores = list(chain.stores) if chain is not None else []
        shared = chain.shared if chain is not None else None
        device_keys: list[BlockHash]
        host_keys: list[BlockHash]
        store_keys: list[BlockHash]
        if command.prompt_token_ids is None:
            device_keys = [bytes(k) for k in pool.ledger.oldest(tenant)]  # type: ignore[call-overload]
            host_keys = [bytes(k) for k in memory.ledger.oldest(tenant)] if memory is not None else []
            # (a store kind without owner records has no keys_of: `all` cannot find its blocks)
            store_keys = list(dict.fromkeys(k for store in stores if hasattr(store, "keys_of")
                                            for k in store.keys_of(tenant)))
            unpinned = self.book.release_all(tenant)
        else:
            hashes, public = self._hashes(command)
            device_keys = host_keys = store_keys = hashes[public:]
            unpinned = self.book.release(tenant, device_keys)
        dropped = dict.fromkeys(["device", *(t.name for t in (chain.tiers if chain is not None else ()))], 0)
        skipped = 0
        for key in device_keys:
            gone = pool.drop(key)
            dropped["device"] += bool(gone)
            skipped += gone is False
        if memory is not None:
            dropped[memory.name] = drop_local(chain, host_keys)
        settle = [k for k in store_keys if chain is not None and may_land(chain, k)]
        self.counters.skipped_in_use += skipped
        tag = self._tag(tenant, command.namespace_salt)
        everything = command.prompt_token_ids is None
        in_flight: list[BlockHash] = []  # being sent to the shared tier: deleted again once there
        if chain is not None and shared is not None:
            in_flight = chain.remote_in_flight(owner=tenant) if everything else chain.remote_in_flight(store_keys)
            # computed again later, they are sent again (the shared tier no longer holds them)
            if everything:
                chain.unsend(owner=tenant)
            else:
                chain.unsend(store_keys)

        def answer(result: dict[str, int]) -> dict[str, Any]:
            self._count_dropped(result)
            return {"ok": True, "dropped_blocks": result, "dropped": sum(result.values()),
                    "skipped_in_use": skipped, "unpinned_blocks": unpinned}

        if chain is None or chain.io is None or not (stores or shared is not None):
            reply(answer(dropped))
            return

        async def below() -> dict[str, Any]:
            if stores and store_keys:
                dropped.update(await drop_stores(chain, stores, store_keys, settle))
            if everything:  # writes in flight land after the first pass: wait for them, then again
                await settle_writes(chain)
                again = list(dict.fromkeys(k for store in stores if hasattr(store, "keys_of")
                                           for k in store.keys_of(tenant)))
                if again:
                    for name, n in (await drop_stores(chain, stores, again)).items():
                        dropped[name] = dropped.get(name, 0) + n
            if shared is not None:
                n = await (shared.delete_owner(tag) if everything else shared.delete(store_keys, tag))
                if n is not None and in_flight:
                    n += await settle_shared(chain, shared, in_flight, tag)
                if n is None:
                    self._count_dropped(dropped)
                    done = ", ".join(f"{name} {k}" for name, k in dropped.items())
                    return refusal(503, f"the {shared.name} tier did not answer the delete, so its blocks there stay "
                                   f"until their TTL (dropped elsewhere: {done}); send the delete again shortly",
                                   "tier_unavailable")
                dropped[shared.name] = n
            return answer(dropped)

        self._submit(below(), reply)

    def _place(self, command: CacheCommand, reply: Reply) -> None:
        """The isolation audit's own operation (engine/audit_place.py, which imports this module)."""
        from engine.audit_place import place

        place(self, command, reply)

    def _count_dropped(self, result: dict[str, int]) -> None:
        with self._counting:
            for name, n in result.items():
                self.counters.dropped_blocks[name] = self.counters.dropped_blocks.get(name, 0) + n

    def _pin(self, command: CacheCommand, reply: Reply) -> None:
        chain = self.core.chain
        host = chain.memory if chain is not None else None
        if host is None:
            reply(refusal(409, "pins keep blocks in the host tier, and this server has none attached "
                               "(POST /admin/tiers attaches one)", "no_host_tier"))
            return
        hashes, public = self._hashes(command)
        run = self._presence(hashes).leading(self._memory_tiers())
        own = hashes[min(public, run):run]  # a public prefix's blocks are nobody's to pin
        tenant, book = command.tenant, self.book
        held = book.held_by(tenant)
        fresh, added = book.cost(tenant, own)
        quota = command.quota.get(host.name)
        if quota is not None and held + fresh > quota:
            reply(refusal(409, f"pinning this prefix takes {fresh} more blocks of the {host.name} tier, and "
                               f"tenant {tenant!r} already holds {held} pinned of its {host.name} quota of {quota} "
                               "blocks; unpin some (POST /v1/cache/unpin) or pin a shorter prefix",
                          "quota_exceeded", "prompt"))
            return
        limit = self.pin_limit()
        if len(book) + added > limit:
            reply(refusal(409, f"pinning this prefix takes {added} more blocks, and the {host.name} tier holds "
                               f"at most {limit} pinned blocks ({PIN_SHARE:.0%} of its {host.capacity_blocks}); "
                               f"{len(book)} are pinned now; unpin some or pin a shorter prefix",
                          "capacity_exceeded", "prompt"))
            return
        book.hold(tenant, own)
        for key in own:
            host.touch(key)
        size = self.core.block_size
        reply({"ok": True, "pinned_blocks": len(own), "pinned_tokens": len(own) * size, "cached_tokens": run * size,
               "new_pins": fresh, "tenant_pinned_blocks": book.held_by(tenant), "quota": quota})

    def _memory_tiers(self) -> set[str]:
        """The tiers a request is served from without I/O: the device and host memory."""
        chain = self.core.chain
        return {"device"} | ({chain.memory.name} if chain is not None and chain.memory is not None else set())

    def _unpin(self, command: CacheCommand, reply: Reply) -> None:
        tenant = command.tenant
        if command.prompt_token_ids is None:
            released = self.book.release_all(tenant)
        else:
            hashes, public = self._hashes(command)
            released = self.book.release(tenant, hashes[public:])
        reply({"ok": True, "unpinned_blocks": released, "tenant_pinned_blocks": self.book.held_by(tenant)})

    def _prefetch(self, command: CacheCommand, reply: Reply) -> None:
        assert command.prompt_token_ids is not None
        core = self.core
        root, switch = core.roots(command.namespace_salt, command.cache_salt, command.public_prefix_len,
                                  command.public_salt)
        token = f"{TOKEN_PREFIX}{next(self._tokens)}"
        seq = Seq(seq_id=token, request_id=token, index=0, token_ids=list(command.prompt_token_ids),
                  params=SamplingParams(max_tokens=1), root_hash=root, block_size=core.block_size,
                  tenant=command.tenant, switch=switch)
        keys = list(core.manager.reusable_hashes(seq.block_hashes, seq.num_tokens))
        job = _Prefetch(command, keys, seq.public_blocks, self._presence(keys), reply)
        # no prefill rate: a caller who asks for a prefetch gets the load, not the cheaper recompute
        if core.tiers.start_prefetch(token, seq, None):
            self._prefetches[token] = job
        else:
            self._finish(job)

    def finished(self, token: str) -> None:
        """The chain's job for prefetch ``token`` ended (`EngineCore.poll_loads`): answer it."""
        job = self._prefetches.pop(token, None)
        if job is not None:
            self._finish(job)

    def _finish(self, job: _Prefetch) -> None:
        """Count what the prefetch brought up and from where, protect the prefix for its TTL."""
        command, size, chain = job.command, self.core.block_size, self.core.chain
        after = self._presence(job.keys)
        up = self._memory_tiers()
        run = after.leading(up)
        shared = chain.shared.name if chain is not None and chain.shared is not None else "remote"
        loaded = after.came_up(job.before, up, shared)
        for source, n in loaded.items():
            self.counters.prefetched_blocks[source] = self.counters.prefetched_blocks.get(source, 0) + n
        host = chain.memory if chain is not None else None
        protected = 0
        if host is not None:  # within the tenant's host quota and the pin budget, from the start
            protected = self.book.hold_within(command.tenant, job.keys[job.own_from:max(run, job.own_from)],
                                              time.monotonic() + command.ttl_s, self.pin_limit(),
                                              command.quota.get(host.name))
        job.reply({"ok": True, "prompt_tokens": len(command.prompt_token_ids or ()), "cached_tokens": run * size,
                   "loaded_blocks": loaded, "loaded_tokens": sum(loaded.values()) * size,
                   "protected_blocks": protected, "ttl_s": command.ttl_s,
                   "expires_at": round(time.time() + command.ttl_s, 3)})

    def pin_limit(self) -> int:
        chain = self.core.chain
        host = chain.memory if chain is not None else None
        return int(host.capacity_blocks * PIN_SHARE) if host is not None else 0

    # ---- metrics ----------------------------------------------------------------------------
    def snapshot(self) -> CacheControlSnapshot:
        """Pins and prefetches for `/admin/metrics` (``cache_control``; docs/metrics.md)."""
        chain = self.core.chain
        pins = self.book.snapshot()
        pinned: dict[str, int] = {"device": sum(1 for k in self.book if self._on_device(k))}
        for tier in chain.tiers if chain is not None else ():
            if hasattr(tier, "protected") and hasattr(tier, "__contains__"):
                pinned[tier.name] = sum(1 for k in self.book if k in tier)
        c = self.counters
        with self._counting:
            dropped = dict(c.dropped_blocks)
        return CacheControlSnapshot(
            pinned_blocks=pinned, pinned_keys=pins.pinned_keys, protected_keys=pins.protected_keys,
            held_by_tenant=pins.by_tenant, pin_limit=self.pin_limit(), requests=dict(c.requests),
            prefetches_in_flight=len(self._prefetches), prefetched_blocks=dict(c.prefetched_blocks),
            expired_protections=pins.expired, dropped_blocks=dropped, skipped_in_use=c.skipped_in_use)
