"""The tiers below the device pool, joined to it: what `EngineCore` asks of them and when.

Evictions demote a block into the chain, admissions promote a prefix out of it, a new request's
prefix is prefetched from disk or a shared store before it is scheduled, the blocks a step
filled are written through or behind, and on close the pool is flushed to disk. Which tiers
exist, and how each keeps its blocks, is the chain's business (cache/tiers/); this module only
knows the device side: the pool, its storage rows and the scheduler.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from cache.kv_storage import KVStorage
from cache.manager import KVCacheManager
from cache.quota import PUBLIC, UNKNOWN
from cache.tiers import factory
from cache.tiers.chain import RETRY, TierChain
from cache.tiers.codec import BlockFormat
from engine.config import EngineConfig
from engine.model import LoadedModel
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.tenancy import TenantQuotas

logger = logging.getLogger(__name__)


def host_rows(config: EngineConfig, loaded: LoadedModel) -> int:
    """Rows to add to the KV tensor for a host tier sharing it (CPU, host tier on), else 0."""
    if not config.share_host_slab or config.host_cache_mb <= 0 or loaded.device.type != "cpu":
        return 0
    layers, kv_heads, head_dim = loaded.kv_shape
    block_nbytes = layers * 2 * config.block_size * kv_heads * head_dim * loaded.dtype.itemsize
    return (config.host_cache_mb << 20) // block_nbytes


class Tiering:
    """The chain under one engine's device pool (None until a tier is configured or attached)."""

    def __init__(self, config: EngineConfig, storage: KVStorage, manager: KVCacheManager,
                 block_format: BlockFormat) -> None:
        self.config = config
        self.storage = storage
        self.manager = manager
        self.block_format = block_format
        self.block_size = config.block_size
        # storage rows no device block owns, lent to a host tier sharing the pool's tensor
        self.rows = factory.RowBank(storage.slab() if storage.device.type == "cpu" else None, list(storage.spare()))
        self.quotas = TenantQuotas(manager.pool.ledger)
        self.chain: TierChain | None = None
        names = config.tiers_on()
        if names:
            tiers = [self._make_tier(name, {}) for name in names]
            logger.info("cache tiers: %s", "; ".join(f"{t.name} {_summary(t)}" for t in tiers))
            self._use(TierChain(tiers, persist=config.disk_persist, admit=config.admit,
                                behind_delay_s=config.disk_behind_delay_s))

    def _use(self, chain: TierChain) -> None:
        """Put the chain under the device pool: evictions demote into it."""
        self.chain = chain
        self.manager.pool.on_evict = self.demote

    def _make_tier(self, name: str, overrides: dict[str, Any], trusted: bool = True) -> Any:
        """Build a tier from the engine config, ``overrides`` (a request's) on top; ValueError if invalid."""
        options = factory.validate(name, self.config.tier_options().get(name, {}), overrides)
        ctx = factory.BuildContext(self.block_format, self.storage.block_nbytes, self.config.tier_policy,
                                   pin_memory=self.storage.device.type == "cuda", rows=self.rows,
                                   allowed_root=self.config.disk_allowed_root, trusted=trusted)
        tier = factory.build(name, options, ctx)
        tier.life.enabled = self.config.metrics
        return tier

    # ---- attach and detach while serving ------------------------------------------------------
    def configure(self, action: str, name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Attach or detach a tier; returns ``{"ok", "action", "tier"}`` plus, after an attach,
        the tier's ``healthy`` and what it describes of itself. Raises ValueError (bad request)
        or OSError (e.g. a disk folder that cannot be created)."""
        factory.kind_of(name)
        if action not in ("attach", "detach"):
            raise ValueError(f"unknown action {action!r}; use attach or detach")
        if self.chain is None:
            self._use(TierChain(persist=self.config.disk_persist, admit=self.config.admit,
                                behind_delay_s=self.config.disk_behind_delay_s))
        chain = self.chain
        assert chain is not None
        if action == "detach":
            tier = chain.detach(name, self.config.flush_on_shutdown_s)
            if getattr(tier, "shared", False):  # a memory tier on the pool's rows: they wait for the next one
                self.rows.give_back(tier.rows() - tier.reserved_rows(), tier.reserved_rows())
        else:
            if chain.tier(name) is not None:
                raise ValueError(f"the {name} tier is already attached; detach it first")
            tier = self._make_tier(name, dict(options or {}), trusted=False)
            try:
                chain.attach(tier)
            except ValueError:
                if getattr(tier, "shared", False):
                    self.rows.give_back(tier.rows(), set())
                raise
            self.quotas.reapply(chain.tiers)
        logger.info("cache tier %s %sed", name, action)
        reply: dict[str, Any] = {"ok": True, "action": action, "tier": name}
        if action == "attach":
            detail = tier.describe()
            reply.update({k: detail[k] for k in ("path", "url", "unhealthy_reason") if detail.get(k) is not None})
            reply["healthy"] = detail.get("healthy", True)
            if tier.capacity_blocks:
                reply["capacity_blocks"] = tier.capacity_blocks
        return reply

    def set_quota(self, tenant: str, quota: Mapping[str, int], salt: bytes) -> None:
        """A request's tenant quota, to the device ledger and every attached tier."""
        self.quotas.update(tenant, quota, salt, self.chain.tiers if self.chain is not None else ())

    # ---- blocks moving between the pool and the chain -----------------------------------------
    def demote(self, block: Any, block_hash: bytes) -> None:
        """An evicted device block goes down the chain (the pool's ``on_evict``)."""
        assert self.chain is not None
        owner = self.manager.pool.ledger.owner_of(block_hash) or UNKNOWN
        if block.hits:
            self.chain.note_reuse(block_hash)
        row = self.chain.demote(block_hash, self.storage.block_view(block.slot), owner, block.slot)
        if row is not None:  # the host tier kept the block's row and gave it one of its own
            block.slot = row

    def promote(self, seq: Sequence) -> int:
        """Bring the continuation of ``seq``'s cached prefix up into device blocks; how many."""
        return self.manager.promote(seq.block_hashes, seq.num_tokens, self._load_block, seq.tenant, seq.public_blocks)

    def served_by_tier(self, seq: Sequence) -> dict[str, int]:
        """Of ``seq``'s cached prompt tokens, how many each tier served (tiers that served none left out)."""
        memory = self.chain.memory.name if self.chain is not None and self.chain.memory is not None else None
        return split_by_tier(max(seq.num_cached_tokens, 0), self.block_size, seq.lower_blocks, seq.fetched, memory)

    def _load_block(self, block_hash: bytes, block_id: int) -> bool:
        assert self.chain is not None
        block = self.manager.pool.blocks[block_id]
        row = self.chain.take(block_hash, block.slot)
        if row is not None:  # the host tier handed over the row holding it: nothing copied
            block.slot = row
            return True
        return self.chain.load(block_hash, self.storage.block_view(block.slot))

    def start_prefetch(self, request_id: str, seq: Sequence, prefill_tps: float | None) -> bool:
        """If the prompt's prefix continues on disk or in a shared store, start loading it off the
        step loop; True = the request waits for it (`poll`)."""
        chain = self.chain
        if chain is None or chain.io is None or not self.config.enable_prefix_caching:
            return False
        rest = list(self.manager.missing_hashes(seq.block_hashes, seq.num_tokens))
        if not rest:
            return False
        chain.recall(rest, seq.tenant)  # blocks whose disk writes are still in flight: back into host
        need = chain.plan_prefetch(rest, self.block_size, prefill_tps)
        remote_keys = rest[chain.local_end(rest):] if chain.shared is not None else []
        return chain.prefetch(request_id, need, also_wait_for=rest, remote_keys=remote_keys,
                              block_tokens=self.block_size, prefill_tokens_per_s=prefill_tps, owner=seq.tenant)

    def cancel(self, request_id: str) -> None:
        if self.chain is not None:
            self.chain.cancel(request_id)

    def poll(self, waiting: bool, busy: bool = False) -> list[tuple[str, Any]]:
        """Let the chain start its background disk writes (``busy``: steps run back to back, so
        young blocks' writes may wait, `TierChain.persist_behind`); with requests ``waiting``,
        return the prefetches that finished as (request id, their times or None)."""
        chain = self.chain
        if chain is None:
            return []
        chain.persist_behind(busy)
        if not waiting:
            return []
        return [(str(token), chain.finished_jobs.pop(str(token), None)) for token in chain.poll()]

    # ---- the blocks a step filled -------------------------------------------------------------
    def after_step(self, work: list[ScheduledSeq]) -> None:
        """Note the blocks this step's new requests reused (admission by reuse, ``write =
        "selective"``); send the blocks it filled to a write-through store, and offer them to the
        background disk writer (``persist = "behind"`` or ``"idle"``)."""
        chain = self.chain
        if chain is None:
            return
        through = chain.writes_through
        behind = chain.writes_behind and chain.store is not None and self.storage.device.type == "cpu"
        by_owner: dict[str, list[tuple[bytes, bytes]]] = {}
        for block, key, owner in self._reused_blocks(work):
            chain.note_reuse(key)
            if chain.remote_wants(key):
                by_owner.setdefault(owner, []).append((key, self.storage.read_block(block.slot)))
            if behind and chain.admit != "always":  # admitted only now: the background writer may take it
                chain.note_computed(key, functools.partial(self._copy_device_block, block, key, block.slot), owner)
        if through or behind:
            for block, key, owner in self._filled_blocks(work):
                if through:
                    by_owner.setdefault(owner, []).append((key, self.storage.read_block(block.slot)))
                if behind:
                    chain.note_computed(key, functools.partial(self._copy_device_block, block, key, block.slot),
                                        owner)
        for owner, items in by_owner.items():
            chain.write_remote(items, owner)

    def _reused_blocks(self, work: list[ScheduledSeq]) -> Iterator[tuple[Any, bytes, str]]:
        """(block, its hash, its owner) for each cached block a request admitted in this step
        reused: the blocks before its first computed token."""
        for s in work:
            seq = s.seq
            if s.start == 0 or s.start != seq.num_cached_tokens:
                continue
            for i, block in enumerate(self.manager.blocks(seq.seq_id)[:s.start // self.block_size]):
                if block.block_hash is not None:
                    yield block, block.block_hash, PUBLIC if i < seq.public_blocks else seq.tenant

    def _filled_blocks(self, work: list[ScheduledSeq]) -> Iterator[tuple[Any, bytes, str]]:
        """(block, its hash, its owner) for each hashed block this step filled."""
        for s in work:
            lo, hi = s.start // self.block_size, (s.start + s.num_new) // self.block_size
            for i, block in enumerate(self.manager.blocks(s.seq.seq_id)[lo:hi], lo):
                if block.block_hash is not None:
                    yield block, block.block_hash, PUBLIC if i < s.seq.public_blocks else s.seq.tenant

    def _copy_device_block(self, block: Any, key: bytes, slot: int) -> bytes | None:
        """A cached device block's bytes, copied on a writer thread: None once the block no longer
        holds ``key`` in ``slot``; `RETRY` when a block was allocated during the copy (its row
        may have been reused and rewritten, so the copy may be torn). A cached block's row is
        written only after an allocation takes it, and allocations are counted before that."""
        allocations = self.manager.pool.stats.allocations
        if block.block_hash != key or block.slot != slot:
            return None
        data = self.storage.block_view(slot).numpy().tobytes()
        if block.block_hash != key or block.slot != slot:
            return None
        return data if self.manager.pool.stats.allocations == allocations else RETRY

    # ---- whole-pool operations ----------------------------------------------------------------
    def spill_device(self) -> int:
        """Demote every idle cached device block and forget it on the device; how many left."""
        pool = self.manager.pool
        idle = [(h, b) for h, b in pool.cached_blocks() if b.ref_cnt == 0]
        if self.chain is not None:
            for block_hash, block in idle:
                self.demote(block, block_hash)
        pool.evict_all_cached()
        return len(idle)

    def check_invariants(self) -> None:
        """The memory tier's accounting, and every KV storage row has exactly one owner — a device
        block, the memory tier or the row bank (rows a detached tier's reads still fill excepted)."""
        host = self.chain.memory if self.chain is not None else None
        if host is not None:
            host.check_invariants()
        owners = [b.slot for b in self.manager.pool.blocks] + self.rows.owners()
        if host is not None and host.shared:
            owners += sorted(host.rows())
        assert sorted(owners) == list(range(self.storage.num_rows)), "a storage row has no owner or two"

    def close(self) -> None:
        """Write what the device and host hold to disk (bounded in time), then stop the I/O."""
        chain = self.chain
        if chain is None:
            return
        limit = self.config.flush_on_shutdown_s
        if chain.store is not None and limit > 0:
            storage, ledger = self.storage, self.manager.pool.ledger
            blocks = [(h, lambda b=b: storage.read_block(b.slot), ledger.owner_of(h) or UNKNOWN)
                      for h, b in self.manager.pool.cached_blocks()]
            for key, block in self.manager.pool.cached_blocks():
                if block.hits:
                    chain.note_reuse(key)
            t0 = time.monotonic()
            written = chain.flush(blocks, limit)
            drained = chain.drain_writes(limit)
            logger.info("cache tiers flushed %d blocks to disk in %.1f s (%d blocks there in all)%s", written,
                        time.monotonic() - t0, len(chain.store),
                        "" if drained else f"; {chain.pending_writes} writes still in flight were abandoned")
        chain.close()


def split_by_tier(cached_tokens: int, block_size: int, lower_blocks: int, fetched: list[tuple[str, int]],
                  memory: str | None) -> dict[str, int]:
    """A cached prefix of ``cached_tokens``, by the tier each part came from, in prefix order: the
    device's own blocks, then the ``lower_blocks`` brought up from below, of which the last ones
    are what a prefetch read (``fetched``: per tier, top down) and the rest were in host memory
    (``memory``). Blocks read but not part of the prefix are taken off the deepest tier first;
    tiers that served nothing are left out."""
    blocks = -(-cached_tokens // block_size)
    lower = min(lower_blocks, blocks)
    parts: list[tuple[str, int]] = [("device", blocks - lower)]
    read: list[tuple[str, int]] = []
    left = lower
    for name, count in reversed(fetched):  # deepest first: a prefix ends in the deepest tier it reached
        take = min(count, left)
        read.append((name, take))
        left -= take
    parts.append((memory or (fetched[0][0] if fetched else "device"), left))
    parts.extend(reversed(read))
    split: dict[str, int] = {}
    tokens = cached_tokens
    for name, count in parts:
        served = min(count * block_size, tokens)
        tokens -= served
        if served:
            split[name] = split.get(name, 0) + served
    return split


def _summary(tier: Any) -> str:
    """A tier in a log line: where it keeps its blocks and how many fit (never a password)."""
    detail = tier.describe()
    where = detail.get("path") or detail.get("url")
    size = f"{tier.capacity_blocks} blocks ({tier.capacity_blocks * tier.block_nbytes >> 20} MiB)" \
        if tier.capacity_blocks and hasattr(tier, "block_nbytes") else \
        (f"{tier.capacity_blocks} blocks" if tier.capacity_blocks else "")
    return " ".join(part for part in (str(where) if where else "", size) if part)
