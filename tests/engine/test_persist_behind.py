"""``persist = "behind"`` (and ``"idle"``) in the engine: computed device blocks and host blocks
reach the disk in the background, so an engine that is never closed (a crash, a `kill -9`) leaves
its prefixes on disk for the next one, which gives the cold run's exact tokens."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.engine.test_tiers_engine import flood, make_engine, prompt, run

WAIT_S = 30.0


def settle(core) -> None:
    """Let the background writer catch up, as the engine loop's idle polls do."""
    deadline = time.monotonic() + WAIT_S
    while core.chain._unpersisted or core.chain.pending_writes:
        assert time.monotonic() < deadline, "the background writes never caught up"
        core.poll_loads()
        time.sleep(0.005)


@pytest.mark.parametrize(("share", "persist"), [(True, "behind"), (False, "behind"), (True, "idle")],
                         ids=["host-shares-the-slab", "host-copies", "idle-writer"])
def test_blocks_survive_an_engine_that_is_never_closed(tiny_model_dir: Path, tmp_path: Path, share: bool,
                                                       persist: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written behind, on the normal writers or on the idle one."""
    from cache.tiers import ioloop

    # the idle writer's scheduling class is tested on its own (test_tier_chain); under it, this
    # test would wait on whatever else the machine runs
    monkeypatch.setattr(ioloop, "_idle_only", lambda: None)
    folder = str(tmp_path / "kv")
    first = make_engine(tiny_model_dir, disk_cache_path=folder, disk_persist=persist, share_host_slab=share)
    a, b = prompt(1), prompt(2)
    cold_a, _ = run(first, "a", a)
    flood(first, 1)  # a's blocks go down to host
    cold_b, _ = run(first, "b", b)  # b's stay on the device
    settle(first)
    chain = first.chain.snapshot()["chain"]
    assert chain["persisted_behind"] >= 60 and chain["dropped_writes"] == 0
    assert first.chain.store.stats.corrupt == 0
    # no close(): nothing is flushed, as after a kill -9; the I/O thread is a daemon
    second = make_engine(tiny_model_dir, disk_cache_path=folder, disk_persist="behind")
    try:
        assert first.chain.stats.flushed_blocks == 0
        for ids, cold, name in ((a, cold_a, "a2"), (b, cold_b, "b2")):
            warm, cached = run(second, name, ids)
            assert warm == cold
            assert cached == 120
        assert second.chain.store.stats.hits >= 60
    finally:
        second.close()
        first.chain.close()


def test_on_evict_leaves_device_and_host_blocks_unwritten_until_close(tiny_model_dir: Path, tmp_path: Path) -> None:
    """on_evict writes a block only when it leaves host memory (or at close)."""
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"), disk_persist="on_evict")
    try:
        run(core, "a", prompt(1))
        core.poll_loads()
        assert core.chain.pending_writes == 0 and len(core.chain.store) == 0
        assert core.chain.snapshot()["chain"]["persist"] == "on_evict"
    finally:
        core.close()
    assert core.chain.stats.flushed_blocks >= 30


def test_a_prefix_whose_disk_writes_are_in_flight_is_served_whole(tiny_model_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Within one life: a prefix pushed out of host while the disk's writes are stalled is found
    (recalled from the writes' buffers), not recomputed from its first missing block on."""
    import cache.tiers.disk
    from tests.cache.test_chain_no_loss import SlowDisk

    monkeypatch.setattr(cache.tiers.disk, "DiskTier", SlowDisk)  # what the factory's disk builder imports
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"), share_host_slab=False,
                       host_cache_mb=1)
    try:
        core.chain.store.gate.clear()  # every disk write waits
        a = prompt(1)
        cold, _ = run(core, "a", a)
        for seed in range(1, 8):  # 700 blocks through a 64-block pool and a 512-block host
            flood(core, seed)  # a's blocks left the device, then host: only the stalled writes hold them
        assert core.chain.pending_writes > 0 and len(core.chain.store) == 0
        warm, cached = run(core, "a2", a)
        assert warm == cold
        assert cached == 120
        assert core.chain.stats.recalled_blocks >= 1 and core.chain.stats.dropped_writes == 0
    finally:
        core.chain.store.gate.set()
        core.close()


def test_writes_behind_wait_while_steps_run_back_to_back(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``disk_behind_delay_s``: the loop's polls between busy steps start no write of a block
    younger than the delay; the first poll with nothing to step writes them all."""
    from engine.outputs import GenerateRequest
    from engine.sampling_params import SamplingParams

    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"), disk_persist="behind",
                       disk_behind_delay_s=3600.0)
    try:
        core.add_request(GenerateRequest("long", prompt(1), SamplingParams(max_tokens=40, temperature=0,
                                                                          ignore_eos=True)))
        steps = 0
        while core.has_work():
            core.poll_loads()  # as the engine loop does before each step
            core.step()
            steps += 1
        assert steps > 5
        chain = core.chain.snapshot()["chain"]
        assert chain["persisted_behind"] == 0 and core.chain.pending_writes == 0
        assert chain["unpersisted_blocks"] >= 30 and chain["behind_delay_s"] == 3600.0
        settle(core)  # idle polls: written at once
        assert core.chain.stats.persisted_behind >= 30 and len(core.chain.store) >= 30
    finally:
        core.close()

