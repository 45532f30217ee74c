"""The cache control API inside the engine (engine/cache_control.py): lookups per tier without a
forward pass, drops from every tier, pins that survive another tenant's flood, pins past a quota,
prefetches from disk with a protection that runs out — each against the real tiny model, with
the cold run's exact tokens after every change."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from engine.cache_control import CacheCommand
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from engine.snapshot import CacheControlSnapshot
from tests.engine.drive import outputs

BLOCK = 4
PROMPT_LEN = 121  # 30 full blocks + 1 token
SALTS = {"acme": b"salt-of-acme", "globex": b"salt-of-globex"}


def make_engine(model_dir: Path, **overrides: Any) -> EngineCore:
    kwargs: dict[str, Any] = dict(model=str(model_dir), block_size=BLOCK, num_blocks=64,
                                  max_num_batched_tokens=128, host_cache_mb=1,
                                  store_mac_key=bytes(range(100, 132)))  # the deployment's store key
    kwargs.update(overrides)
    return EngineCore(EngineConfig(**kwargs))


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def run(core: EngineCore, request_id: str, ids: list[int], tenant: str = "acme",
        quota: dict[str, int] | None = None) -> tuple[list[int], int]:
    core.add_request(GenerateRequest(request_id, ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                     namespace_salt=SALTS[tenant], tenant=tenant, quota=quota or {}))
    tokens, cached = [], -1
    for out in outputs(core):
        tokens.append(out.token_id)
        cached = out.num_cached_tokens if cached < 0 else cached
    return tokens, cached


def control(core: EngineCore, op: str, ids: list[int] | None = None, tenant: str = "acme",
            **fields: Any) -> dict[str, Any]:
    """Run one command as the engine loop does, polling until its reply comes (from any thread)."""
    answers: list[dict[str, Any]] = []
    core.cache_control(CacheCommand(op, tenant, SALTS[tenant], tuple(ids) if ids is not None else None, **fields),
                       answers.append)
    deadline = time.monotonic() + 20
    while not answers:
        assert time.monotonic() < deadline, f"no answer to {op}"
        core.poll_loads()
        time.sleep(0.001)
    return answers[0]


def to_disk(core: EngineCore) -> None:
    """Everything cached goes to disk and leaves the device and host (loading is made the choice)."""
    core.spill_device()
    assert core.chain.flush([], timeout_s=30) > 0
    core.chain.memory.clear()
    core.chain.store.rate.bytes_per_s, core.chain.store.rate.latency_s = 1e12, 0.0


def test_lookup_follows_the_prefix_down_the_tiers_and_computes_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        a = prompt(1)
        empty = control(core, "lookup", a)
        assert empty == {"ok": True, "prompt_tokens": 121, "block_size": BLOCK, "cached_tokens": 0,
                         "tiers": {"device": 0, "host": 0, "disk": 0}, "blocks": {"device": 0, "host": 0, "disk": 0}}
        run(core, "a1", a)
        steps = core.counters.steps
        assert control(core, "lookup", a)["tiers"] == {"device": 120, "host": 0, "disk": 0}
        core.spill_device()
        on_host = control(core, "lookup", a)
        assert on_host["cached_tokens"] == 120 and on_host["tiers"] == {"device": 0, "host": 120, "disk": 0}
        to_disk(core)
        on_disk = control(core, "lookup", a)
        assert on_disk["tiers"] == {"device": 0, "host": 0, "disk": 120} and on_disk["blocks"]["disk"] == 30
        assert control(core, "lookup", a[:60] + prompt(2, 61))["cached_tokens"] == 60  # the shared part only
        assert control(core, "lookup", a, tenant="globex")["cached_tokens"] == 0  # another namespace
        assert control(core, "lookup", a, cache_salt="user-1")["cached_tokens"] == 0
        assert core.counters.steps == steps and core.num_loading == 0  # no forward pass, nothing loaded
        snap = core.stats()["cache_control"]
        assert list(snap) == [f.name for f in fields(CacheControlSnapshot)] and snap["requests"]["lookup"] == 7
    finally:
        core.close()


def test_delete_drops_a_prefix_in_every_tier_and_the_next_request_recomputes(tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        a, b = prompt(3), prompt(4)
        cold, _ = run(core, "a1", a)
        run(core, "b1", b)
        to_disk(core)
        run(core, "a2", a)  # back on the device and in host (and still on disk)
        core.spill_device()
        assert control(core, "lookup", a)["blocks"] == {"device": 0, "host": 30, "disk": 30}
        stranger = control(core, "delete", a, tenant="globex")
        assert stranger["dropped"] == 0  # another tenant's prompt: nothing of theirs
        gone = control(core, "delete", a)
        assert gone["dropped_blocks"] == {"device": 0, "host": 30, "disk": 30} and gone["skipped_in_use"] == 0
        assert control(core, "lookup", a)["blocks"] == {"device": 0, "host": 0, "disk": 0}
        assert run(core, "a3", a) == (cold, 0)  # recomputed, the same tokens
        assert control(core, "lookup", b)["cached_tokens"] == 120  # the other prefix is untouched
        core.check_invariants()
        core.chain.store.check_invariants()
    finally:
        core.close()


def test_a_delete_also_catches_the_background_writes_in_flight(tiny_model_dir: Path, tmp_path: Path) -> None:
    """persist = "behind": blocks being written in the background when a delete of their prompt
    comes land on disk after it; the delete waits for them and deletes them there too."""
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"), disk_persist="behind")
    store = core.chain.store
    gate = threading.Event()
    original = store.write

    held_keys: list[bytes] = []

    async def held(key: bytes, *args: Any, **kwargs: Any) -> Any:  # every disk write waits for the gate
        held_keys.append(key)  # its bytes are copied by now
        while not gate.is_set():
            await asyncio.sleep(0.005)
        return await original(key, *args, **kwargs)

    store.write = held
    try:
        a = prompt(5)
        run(core, "a1", a)
        deadline = time.monotonic() + 20
        while not held_keys:  # the background writes start between steps, copy, then wait
            assert time.monotonic() < deadline, "no background write reached the disk tier"
            core.poll_loads()
            time.sleep(0.005)
        in_flight = set(held_keys)
        threading.Timer(0.3, gate.set).start()  # they land while the delete waits for them
        gone = control(core, "delete", a)
        # on disk only after the delete's first pass: what it dropped there, it dropped once they landed
        assert gone["dropped_blocks"]["device"] == 30 and gone["dropped_blocks"]["disk"] >= 1
        assert core.chain.drain_writes(timeout_s=20) and not core.chain._persisting
        assert control(core, "lookup", a)["blocks"] == {"device": 0, "host": 0, "disk": 0}
        hashes, _ = core.control._hashes(CacheCommand("lookup", "acme", SALTS["acme"], tuple(a)))
        assert in_flight & set(hashes) and not any(key in store for key in hashes)  # (a decode-filled block stays)
        store.check_invariants()
    finally:
        gate.set()
        core.close()


def test_delete_all_drops_only_the_tenants_own_blocks(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        mine, theirs = prompt(5), prompt(6)
        run(core, "a1", mine)
        run(core, "g1", theirs, tenant="globex")
        core.spill_device()
        assert core.chain.flush([], timeout_s=30) == 62  # 31 full blocks each (prompt and output)
        run(core, "a2", prompt(7))  # a third prefix, on the device
        gone = control(core, "delete", None)
        assert gone["dropped_blocks"] == {"device": 31, "host": 31, "disk": 31}
        assert control(core, "lookup", mine)["cached_tokens"] == 0
        assert control(core, "lookup", prompt(7))["cached_tokens"] == 0
        assert control(core, "lookup", theirs, tenant="globex")["blocks"] == {"device": 0, "host": 30, "disk": 30}
        core.check_invariants()
    finally:
        core.close()


def test_blocks_a_running_request_holds_are_skipped(tiny_model_dir: Path) -> None:
    core = make_engine(tiny_model_dir)
    try:
        a = prompt(8)
        core.add_request(GenerateRequest("a1", a, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                                         namespace_salt=SALTS["acme"], tenant="acme"))
        while core.manager.pool.num_cached_blocks < 30:
            core.step()
        held = control(core, "delete", a)
        assert held["dropped_blocks"]["device"] == 0 and held["skipped_in_use"] == 30
        for _ in outputs(core):
            pass
        assert control(core, "delete", a)["dropped_blocks"]["device"] == 30  # idle now
        core.check_invariants()
    finally:
        core.close()


def test_a_pin_survives_another_tenants_flood_and_unpinned_it_goes(tiny_model_dir: Path) -> None:
    core = make_engine(tiny_model_dir, block_size=16, num_blocks=48, max_num_batched_tokens=256)
    try:
        capacity = core.chain.memory.capacity_blocks  # 1 MiB of 8 KiB blocks: 128
        a = prompt(9, 161)  # 10 full blocks
        cold, _ = run(core, "a1", a)
        pinned = control(core, "pin", a)
        assert pinned["pinned_blocks"] == 10 and pinned["new_pins"] == 10 and pinned["tenant_pinned_blocks"] == 10

        def flood(seed: int) -> None:  # twice the host tier in one-off blocks of another tenant
            for i in range(2 * capacity // 12 + 1):
                run(core, f"flood-{seed}-{i}", prompt(1000 * seed + i, 200), tenant="globex")

        flood(1)
        assert control(core, "lookup", a)["tiers"]["host"] == 160
        assert core.stats()["cache_control"]["pinned_blocks"]["host"] == 10
        assert run(core, "a2", a) == (cold, 160)
        flood(2)  # back on the device, demoted again, still pinned: it comes back again
        assert control(core, "lookup", a)["cached_tokens"] == 160
        assert control(core, "unpin", a) == {"ok": True, "unpinned_blocks": 10, "tenant_pinned_blocks": 0}
        flood(3)
        assert control(core, "lookup", a)["cached_tokens"] == 0  # an ordinary block again: evicted
        core.check_invariants()
    finally:
        core.close()


def test_a_pin_past_the_quota_or_the_budget_is_refused_and_nothing_is_pinned(tiny_model_dir: Path) -> None:
    core = make_engine(tiny_model_dir)
    try:
        a, b = prompt(10), prompt(11)
        run(core, "a1", a, quota={"host": 40})
        run(core, "a2", b, quota={"host": 40})
        assert control(core, "pin", a, quota={"host": 40})["pinned_blocks"] == 30
        refused = control(core, "pin", b, quota={"host": 40})
        assert refused["ok"] is False and refused["status"] == 409 and refused["code"] == "quota_exceeded"
        assert "quota of 40" in refused["message"] and "already holds 30" in refused["message"]
        assert core.control.book.held_by("acme") == 30
        assert control(core, "pin", a, quota={"host": 40})["new_pins"] == 0  # pinning again costs nothing
        assert control(core, "pin", prompt(12), quota={"host": 40})["pinned_blocks"] == 0  # not cached: nothing
        assert control(core, "unpin", None)["unpinned_blocks"] == 30
        limit = core.control.pin_limit()
        core.control.book.hold("other", [bytes([i % 256, i // 256]) * 16 for i in range(limit - 10)])
        over = control(core, "pin", b)
        assert over["status"] == 409 and over["code"] == "capacity_exceeded" and f"at most {limit}" in over["message"]
    finally:
        core.close()


def test_prefetch_brings_a_disk_prefix_up_and_protects_it_until_its_ttl(tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        a = prompt(13)
        cold, _ = run(core, "a1", a)
        to_disk(core)
        steps = core.counters.steps
        up = control(core, "prefetch", a, ttl_s=30.0)
        assert up["loaded_blocks"] == {"disk": 30} and up["loaded_tokens"] == 120 and up["cached_tokens"] == 120
        assert up["protected_blocks"] == 30 and up["ttl_s"] == 30.0 and up["expires_at"] > time.time() + 25
        assert core.counters.steps == steps  # loaded off the step loop, nothing computed
        assert control(core, "lookup", a)["tiers"]["host"] == 120
        snap = core.stats()["cache_control"]
        assert snap["protected_keys"] == 30 and snap["prefetched_blocks"] == {"disk": 30}
        assert control(core, "prefetch", a)["loaded_blocks"] == {}  # already up: nothing to load
        assert run(core, "a2", a) == (cold, 120)
        core.control.tick(time.monotonic() + 3600)  # past the TTL: ordinary blocks again
        snap = core.stats()["cache_control"]
        assert snap["protected_keys"] == 0 and snap["expired_protections"] == 30
        assert control(core, "prefetch", prompt(14))["loaded_blocks"] == {}  # never cached: nothing
        core.check_invariants()
    finally:
        core.close()


def test_prefetch_and_delete_reach_the_remote_tier(tiny_model_dir: Path, redis_url: str, redis_server: Any) -> None:
    core = make_engine(tiny_model_dir, remote_cache_url=redis_url)
    try:
        a = prompt(15)
        cold, _ = run(core, "a1", a)
        deadline = time.monotonic() + 10
        while control(core, "lookup", a)["blocks"]["remote"] < 30:  # written through in the background
            assert time.monotonic() < deadline, "the blocks never reached Redis"
            time.sleep(0.02)
        core.spill_device()
        core.chain.memory.clear()  # only Redis holds the prefix now
        core.chain.shared.rate.bytes_per_s, core.chain.shared.rate.latency_s = 1e12, 0.0
        assert control(core, "lookup", a)["tiers"] == {"device": 0, "host": 0, "remote": 120}
        up = control(core, "prefetch", a)
        assert up["loaded_blocks"] == {"remote": 30} and up["cached_tokens"] == 120
        assert run(core, "a2", a) == (cold, 120)
        gone = control(core, "delete", a)
        assert gone["dropped_blocks"]["remote"] == 30
        with redis_server.client() as client:
            left = [k for k in client.keys("kvgate:*") if b":owner:" not in k]
        assert len(left) == 1  # the block of the first request's output tokens, not the prompt's
        assert control(core, "delete", None)["dropped_blocks"]["remote"] >= 1  # everything acme wrote
        with redis_server.client() as client:
            assert not [k for k in client.keys("kvgate:*") if b":owner:" not in k]
    finally:
        core.close()
