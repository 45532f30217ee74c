"""Tenant isolation in every tier: tenant B sending tenant A's exact 1,000+ token prompt gets
nothing from the device, host, disk or remote tier, and the tiers' own counters show that no
block of A was read for B; A (or a tenant sharing A's salt: the same share group) hits there.

Block keys in every tier are the salted chained hashes (the salt enters the first block's
parent), so this holds by construction; these tests pin it down tier by tier."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from tests.engine.drive import outputs

BLOCK = 16
PROMPT_LEN = 1_024 + 5  # 64 full blocks
SALT_A, SALT_B = b"salt-of-tenant-a", b"salt-of-tenant-b"  # A's group mates hash with A's salt


def make_engine(model_dir: Path, tmp: Path, name: str, redis_url: str | None = None) -> EngineCore:
    return EngineCore(EngineConfig(
        model=str(model_dir), block_size=BLOCK, num_blocks=160, max_num_batched_tokens=512, max_model_len=2048,
        host_cache_mb=64, disk_cache_path=str(tmp / name), remote_cache_url=redis_url,
        store_mac_key=bytes(range(100, 132))))  # one deployment: every replica holds the store key


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def run(core: EngineCore, request_id: str, ids: list[int], salt: bytes) -> int:
    """Serve one request to its end; returns its cached prompt tokens."""
    core.add_request(GenerateRequest(request_id, ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                                     namespace_salt=salt))
    cached = -1
    for out in outputs(core):
        cached = out.num_cached_tokens if cached < 0 else cached
    return cached


def reads(core: EngineCore, tier: str) -> int:
    """What a tier has handed out: device prefix-cache block hits, or a lower tier's hits."""
    stats = core.stats()
    if tier == "device":
        return stats["prefix_cache"]["block_hits"]
    return stats["tiers"][tier]["hits"]


def off_device(core: EngineCore, salt: bytes) -> None:
    """Unrelated long prompts (in the same namespace) that push every idle block off the device."""
    for i in range(3):
        run(core, f"flood-{i}-{time.monotonic_ns()}", prompt(9_000 + i, 1_500), salt)


def test_device(tiny_model_dir: Path, tmp_path: Path) -> None:
    _paired(tiny_model_dir, tmp_path, "device", place=lambda core: None)


def test_host(tiny_model_dir: Path, tmp_path: Path) -> None:
    _paired(tiny_model_dir, tmp_path, "host", place=lambda core: off_device(core, b"flood"))


def test_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    def to_disk(core: EngineCore) -> None:
        off_device(core, b"flood")
        assert core.chain.flush([], timeout_s=30) >= 64
        core.chain.memory.clear()
        # the tiny model recomputes faster than any disk loads: make loading the measured choice
        core.chain.store.rate.bytes_per_s, core.chain.store.rate.latency_s = 1e12, 0.0

    _paired(tiny_model_dir, tmp_path, "disk", place=to_disk)


def _paired(model_dir: Path, tmp: Path, tier: str, place: Callable[[EngineCore], None]) -> None:
    core = make_engine(model_dir, tmp, "kv")
    try:
        a = prompt(1)
        assert run(core, "a-cold", a, SALT_A) == 0
        place(core)  # A's blocks now live in `tier` (and nowhere above it)
        before = reads(core, tier)
        assert run(core, "b-steals", a, SALT_B) == 0
        assert reads(core, tier) == before, f"a block of A was read from {tier} for B"
        place(core)  # B's own copy of the prompt leaves the upper tiers too
        assert run(core, "a-again", a, SALT_A) == 64 * BLOCK
        assert reads(core, tier) - before >= 64
        core.manager.check_invariants()
    finally:
        core.close()


def test_remote(tiny_model_dir: Path, tmp_path: Path, redis_url: str) -> None:
    a = prompt(2)
    first = make_engine(tiny_model_dir, tmp_path, "kv1", redis_url)
    try:
        assert run(first, "a-cold", a, SALT_A) == 0
        assert first.chain.drain_writes(30)  # written through to Redis as computed
    finally:
        first.close()
    second = make_engine(tiny_model_dir, tmp_path, "kv2", redis_url)  # empty device, host and disk
    try:
        assert run(second, "b-steals", a, SALT_B) == 0
        remote = second.stats()["tiers"]["remote"]
        assert remote["hits"] == 0 and remote["bytes_read"] == 0, "a block of A was read from Redis for B"
        assert second.stats()["gaps"]["remote_access"]["blocks"].get("get", 0) == 0  # nothing even fetched
    finally:
        second.close()
    third = make_engine(tiny_model_dir, tmp_path, "kv3", redis_url)
    try:
        assert run(third, "a-mate", a, SALT_A) == 64 * BLOCK  # A's group mate, on another replica
        assert third.stats()["tiers"]["remote"]["hits"] >= 64
    finally:
        third.close()


@pytest.mark.parametrize("salt", [SALT_B, b""])
def test_no_key_in_any_tier_names_or_matches_another_namespace(tiny_model_dir: Path, tmp_path: Path,
                                                               salt: bytes) -> None:
    """The disk files of A's blocks and B's blocks of the same prompt are disjoint sets."""
    a = prompt(3)
    core = make_engine(tiny_model_dir, tmp_path, "kv")
    try:
        run(core, "a", a, SALT_A)
        core.chain.flush([(h, (lambda b=b: core.storage.read_block(b.block_id)))
                          for h, b in core.manager.pool.cached_blocks()], timeout_s=30)
        files_a = {p.name for p in core.chain.store.dir.iterdir()}
        run(core, "b", a, salt)
        core.chain.flush([(h, (lambda b=b: core.storage.read_block(b.block_id)))
                          for h, b in core.manager.pool.cached_blocks()], timeout_s=30)
        files_b = {p.name for p in core.chain.store.dir.iterdir()} - files_a
        assert len(files_a) >= 64 and len(files_b) >= 64
        assert not any(SALT_A.hex() in name or b"tenant".hex() in name for name in files_a | files_b)
    finally:
        core.close()
