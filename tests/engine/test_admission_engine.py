"""Admission by reuse in the engine: with ``admit = "second_use"`` a prompt seen once never
reaches disk and one seen twice does (through eviction and through the shutdown flush); with
``remote_write = "selective"`` Redis gets a block on its first reuse, and another engine then
serves it with the cold run's exact tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache.hashing import extend_block_hashes, root_hash
from engine.core import EngineCore
from tests.engine.test_tiers_engine import BLOCK, flood, make_engine, prompt, run

pytestmark = pytest.mark.engine


def hashes(core: EngineCore, ids: list[int]) -> list[bytes]:
    return extend_block_hashes([], root_hash(b"", core.fingerprint, None), ids, BLOCK)


def stored(core: EngineCore, ids: list[int]) -> int:
    """How many of the prompt's blocks the disk tier holds."""
    return sum(h in core.chain.store for h in hashes(core, ids))


def test_second_use_keeps_a_once_seen_prompt_off_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    once, twice = prompt(21), prompt(22)
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"), admit="second_use",
                       host_cache_mb=0)
    try:
        run(core, "once", once)
        cold, _ = run(core, "twice-1", twice)
        warm, cached = run(core, "twice-2", twice)
        assert warm == cold and cached == 120
        flood(core, 21)  # both prompts leave the device, straight for disk
        assert core.chain.drain_writes(30)
        assert stored(core, once) == 0 and stored(core, twice) == 30
        chain = core.stats()["tiers"]["chain"]
        assert chain["admit"] == "second_use" and chain["not_admitted"] >= 30
    finally:
        core.close()


def test_second_use_through_host_and_the_flush_then_a_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    once, twice = prompt(23), prompt(24)
    first = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"), admit="second_use")
    try:
        run(first, "once", once)
        cold, _ = run(first, "twice-1", twice)
        run(first, "twice-2", twice)
    finally:
        first.close()  # the flush writes only the reused prompt's blocks
    second = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"), admit="second_use")
    try:
        assert stored(second, twice) == 30 and stored(second, once) == 0
        warm, cached = run(second, "twice-3", twice)
        assert warm == cold and cached == 120
        _, cached_once = run(second, "once-2", once)
        assert cached_once == 0
    finally:
        second.close()


def test_selective_sends_a_block_to_redis_on_its_first_reuse(tiny_model_dir: Path, tmp_path: Path,
                                                             redis_url: str) -> None:
    a = prompt(25)
    first = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv1"), remote_cache_url=redis_url,
                        remote_write="selective")
    try:
        cold, _ = run(first, "a1", a)
        assert first.chain.drain_writes(30)
        assert first.stats()["tiers"]["remote"]["puts"] == 0  # computed once: not sent
        run(first, "a2", a)
        assert first.chain.drain_writes(30)
        assert first.stats()["tiers"]["remote"]["puts"] >= 30
    finally:
        first.close()
    second = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv2"), remote_cache_url=redis_url,
                         remote_write="selective")
    try:
        warm, cached = run(second, "a3", a)
        assert warm == cold and cached == 120
        assert second.stats()["tiers"]["remote"]["hits"] >= 30
    finally:
        second.close()
