"""The tier chain inside the engine: evicted prefixes come back from host, from disk, after a
restart, and a damaged disk block is recomputed — always with the cold run's exact tokens."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from tests.engine.drive import outputs

BLOCK = 4
PROMPT_LEN = 121  # 30 full blocks + 1 token


def make_engine(model_dir: Path, **overrides) -> EngineCore:
    kwargs = dict(model=str(model_dir), block_size=BLOCK, num_blocks=64, max_num_batched_tokens=128,
                  host_cache_mb=1, store_mac_key=bytes(range(100, 132)))  # every replica's store key
    kwargs.update(overrides)
    return EngineCore(EngineConfig(**kwargs))


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def run(core: EngineCore, request_id: str, ids: list[int], max_tokens: int = 6) -> tuple[list[int], int]:
    """Drive the engine as its loop does (poll disk loads, step) until the request finishes."""
    core.add_request(GenerateRequest(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True)))
    tokens, cached = [], -1
    for out in outputs(core):
        tokens.append(out.token_id)
        cached = out.num_cached_tokens if cached < 0 else cached
    return tokens, cached


def flood(core: EngineCore, seed: int) -> None:
    """Unrelated prompts that need the whole device pool, evicting every idle cached block."""
    for i in range(2):
        run(core, f"flood-{seed}-{i}", prompt(10_000 + seed * 10 + i, 200), max_tokens=1)


def on_device(core: EngineCore, ids: list[int]) -> bool:
    from cache.hashing import extend_block_hashes, root_hash

    hashes = extend_block_hashes([], root_hash(b"", core.fingerprint, None), ids, BLOCK)
    return core.manager.pool.get_cached_block(hashes[0]) is not None


@pytest.mark.parametrize("share", [True, False], ids=["host-shares-the-slab", "host-copies"])
def test_an_evicted_prefix_comes_back_from_host(tiny_model_dir: Path, share: bool) -> None:
    core = make_engine(tiny_model_dir, share_host_slab=share)
    try:
        assert core.chain.memory.shared == share
        a = prompt(1)
        cold, cached = run(core, "a1", a)
        assert cached == 0
        flood(core, 1)
        assert not on_device(core, a)
        host0 = dict(core.stats()["tiers"]["host"])
        warm, cached = run(core, "a2", a)
        assert warm == cold
        assert cached == 120  # every full block of the prompt, from host
        tiers = core.stats()["tiers"]
        assert tiers["host"]["hits"] >= 30 and tiers["chain"]["promotions"] >= 30
        assert core.stats()["promoted_blocks"] >= 30
        copied = tiers["host"]["bytes_read"] - host0["bytes_read"]
        handed = tiers["host"]["handovers"] - host0["handovers"]
        if share:  # on CPU the host tier's rows are the pool's: a promotion trades rows, copies nothing
            assert copied == 0 and handed >= 30
        else:
            assert copied >= 30 * core.storage.block_nbytes and handed == 0
        core.check_invariants()
    finally:
        core.close()


def test_a_shared_host_tier_detached_and_attached_again_reuses_its_rows(tiny_model_dir: Path) -> None:
    core = make_engine(tiny_model_dir)
    try:
        a, b = prompt(11), prompt(12)
        cold_a, _ = run(core, "a1", a)
        cold_b, _ = run(core, "b1", b)
        flood(core, 11)  # both prefixes now live in the host tier's rows
        rows = core.chain.memory.rows()
        core.configure_tier("detach", "host")
        core.check_invariants()
        assert run(core, "a2", a) == (cold_a, 0)  # gone with the tier: recomputed, same tokens
        core.configure_tier("attach", "host")
        assert core.chain.memory.shared and core.chain.memory.rows() == rows and len(core.chain.memory) == 0
        flood(core, 12)
        assert run(core, "a3", a) == (cold_a, 120)  # demoted into the reattached tier's rows, back again
        assert run(core, "b2", b)[0] == cold_b
        core.configure_tier("detach", "host")
        core.configure_tier("attach", "host", {"capacity_mb": 2})  # more rows than the tensor spares
        assert not core.chain.memory.shared
        flood(core, 13)
        assert run(core, "a4", a) == (cold_a, 120)
        core.check_invariants()
    finally:
        core.close()


def test_with_host_flushed_the_prefix_comes_back_from_disk_without_blocking_other_requests(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        a = prompt(2)
        cold, _ = run(core, "a1", a)
        flood(core, 2)
        assert core.chain.flush([], timeout_s=30) >= 30  # host → disk
        core.chain.memory.clear()
        warm, cached = run(core, "a2", a)
        assert warm == cold and cached == 120
        stats = core.stats()["tiers"]
        assert stats["disk"]["hits"] >= 30 and stats["chain"]["prefetches"] == 1
        assert stats["chain"]["prefetched_blocks"] >= 30
    finally:
        core.close()


def test_a_restart_with_the_same_disk_folder_serves_from_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    a = prompt(3)
    first = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        cold, _ = run(first, "a1", a)
    finally:
        first.close()  # flushes the device and host blocks to disk
    second = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        assert second.chain.store.rebuilt >= 30
        warm, cached = run(second, "a2", a)
        assert warm == cold and cached == 120
        assert second.stats()["tiers"]["disk"]["hits"] >= 30
    finally:
        second.close()


@pytest.mark.parametrize("damage", ["garbage", "truncate"])
def test_a_damaged_disk_block_is_recomputed_and_counted(tiny_model_dir: Path, tmp_path: Path, damage: str) -> None:
    a = prompt(4)
    first = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        cold, _ = run(first, "a1", a)
    finally:
        first.close()
    files = sorted((tmp_path / "kv").glob("*/*.kvb"), key=lambda p: p.stat().st_mtime)
    assert files
    second = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        for path in files:  # damage every stored block after the index was rebuilt
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2] if damage == "truncate" else bytes(len(data)))
        warm, cached = run(second, "a2", a)
        assert warm == cold and cached == 0
        disk = second.stats()["tiers"]["disk"]
        assert disk["corrupt"] >= 1 and disk["hits"] == 0
        assert not any(p.exists() for p in files[:1]) or disk["corrupt"] >= 1
    finally:
        second.close()


def test_abort_while_loading_from_disk_frees_everything(tiny_model_dir: Path, tmp_path: Path) -> None:
    a = prompt(5)
    first = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        run(first, "a1", a)
    finally:
        first.close()
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        core.add_request(GenerateRequest("x", a, SamplingParams(max_tokens=4)))
        assert core.is_loading()
        assert core.abort_request("x")
        assert not core.is_loading() and core.num_requests == 0
        for _ in range(5000):  # late completions for a cancelled request are dropped
            core.poll_loads()
            if core.chain.stats.prefetched_blocks >= 30:
                break
            time.sleep(0.001)
        assert not core.has_work() and core.manager.num_blocks_in_use == 0
    finally:
        core.close()


def _drain_remote_writes(core: EngineCore) -> None:
    assert core.chain.drain_writes(30)


def test_a_new_engine_with_an_empty_disk_but_the_same_redis_serves_from_remote(
        tiny_model_dir: Path, tmp_path: Path, redis_url: str) -> None:
    a = prompt(6)
    first = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv1"), remote_cache_url=redis_url)
    try:
        cold, _ = run(first, "a1", a)
        _drain_remote_writes(first)  # write-through: the blocks went out as they were computed
        assert first.stats()["tiers"]["remote"]["puts"] >= 30
    finally:
        first.close()
    second = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv2"), remote_cache_url=redis_url)
    try:
        warm, cached = run(second, "a2", a)
        assert warm == cold and cached == 120
        tiers = second.stats()["tiers"]
        assert tiers["remote"]["hits"] >= 30 and tiers["disk"]["hits"] == 0
        assert tiers["remote"]["exists_checks"] >= 1 and tiers["remote"]["breaker"] == "closed"
    finally:
        second.close()


def test_with_redis_dead_every_request_still_succeeds_and_the_fault_is_counted(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    reference = make_engine(tiny_model_dir, host_cache_mb=0)
    try:
        expected, _ = run(reference, "ref", prompt(7))
    finally:
        reference.close()
    core = make_engine(tiny_model_dir, remote_cache_url=f"redis://127.0.0.1:{port}/0", remote_timeout_s=0.2)
    try:
        for i in range(3):
            got, cached = run(core, f"x{i}", prompt(7))
            assert got == expected
        remote = core.stats()["tiers"]["remote"]
        assert remote["errors"] >= 1 and remote["hits"] == 0
    finally:
        core.close()
