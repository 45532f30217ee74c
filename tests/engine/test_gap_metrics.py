"""The survey's unmeasured quantities, after a scripted workload whose reuse is known: a prompt
computed once, then served from host, from disk, and (on a second engine) from Redis."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache.telemetry import BlockLife, Histogram
from cache.tiers.codec import HEADER_SIZE
from engine.core import EngineCore
from engine.telemetry import COMPONENTS, EngineTelemetry, RequestTiming
from tests.engine.test_tiers_engine import flood, make_engine, prompt, run

BLOCKS = 30  # full blocks of the scripted prompt


def test_histogram_quantiles_interpolate_inside_buckets() -> None:
    h = Histogram((1.0, 2.0, 4.0))
    assert h.quantile(0.5) is None and h.snapshot()["count"] == 0
    for v in (0.5, 1.5, 1.5, 3.0, 100.0):
        h.observe(v)
    assert h.counts == [1, 2, 1, 1]  # the last one: above every bound
    assert h.quantile(0.2) == pytest.approx(1.0)
    assert h.quantile(0.5) == pytest.approx(1.75)
    assert h.quantile(1.0) == 4.0
    assert h.snapshot()["sum"] == pytest.approx(106.5)


def test_block_life_bounds_what_it_tracks_for_a_store_it_cannot_see_expire() -> None:
    life = BlockLife(max_tracked=3)
    for k in range(10):
        life.inserted(k)
    assert len(life) == 3
    life.accessed(9)  # inserts 7, 8, 9 then this access: two accesses in between? none: 9 was last
    assert life.reuse_distance.count == 1 and life.reuse_distance.sum == 0
    life.accessed(0)  # forgotten: counted as new, not as a reuse
    assert life.reuse_distance.count == 1 and len(life) == 3


def test_ttft_attribution_takes_the_slow_tail_and_its_parts_add_up() -> None:
    tel = EngineTelemetry()
    for _ in range(99):
        tel.first_token(RequestTiming(added=0.0, metadata_s=0.001, prefill_s=0.01), 0.02, 0.001)
    tel.first_token(RequestTiming(added=0.0, metadata_s=0.001, load_s=0.5, prefill_s=0.01, lower_tier=True,
                                  first_scheduled=0.6), 1.0, 0.001)
    att = tel.attribution(0.99)
    assert att["samples"] == 100 and att["tail_requests"] == 1 and att["ttft_s"] == 1.0
    parts = att["components_s"]
    assert parts["tier_load"] == 0.5 and parts["queue"] == pytest.approx(1.0 - 0.512)
    assert sum(att["shares"].values()) == pytest.approx(1.0)
    snap = tel.snapshot()
    assert snap["loads"] == 1 and snap["loads_within_slack"] == 0  # it waited 0.1 s, loaded 0.5 s


def _gaps(core: EngineCore) -> dict:
    return core.stats()["gaps"]


def test_gap_metrics_follow_a_workload_served_from_host_then_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"))
    try:
        a = prompt(21)
        run(core, "cold", a)
        flood(core, 21)  # two requests
        assert run(core, "from-host", a)[1] == BLOCKS * 4
        flood(core, 22)
        assert core.chain.flush([], timeout_s=30) >= BLOCKS
        core.chain.memory.clear()
        assert run(core, "from-disk", a)[1] == BLOCKS * 4
        requests = 7
        stats = core.stats()
        gaps = stats["gaps"]

        # 6: every request's TTFT is split into parts that add up; two of them loaded from below
        att = gaps["ttft_attribution"]
        assert att["samples"] == requests and set(att["components_s"]) == set(COMPONENTS)
        assert sum(att["shares"].values()) == pytest.approx(1.0)
        assert all(v >= 0 for v in att["components_s"].values())
        timing = stats["timing"]
        assert timing["ttft_s"]["count"] == requests and timing["tier_load_s"]["count"] == 2
        assert timing["tier_load_s"]["sum"] > 0 and timing["prefill_s"]["sum"] > 0

        # 2: metadata per request, and bytes describing blocks vs bytes of blocks
        meta = gaps["metadata"]
        assert meta["per_request_s"]["count"] == requests and meta["per_request_s"]["sum"] > 0
        assert meta["lookups"] == requests and meta["hash_time_s"] > 0
        disk = stats["tiers"]["disk"]
        assert meta["by_tier"]["disk"]["metadata_bytes"] == HEADER_SIZE * (disk["puts"] + disk["hits"])
        assert 0 < meta["bytes_ratio"] < 0.1

        # 3: the disk loads and writes, issue-to-done against raw transfer
        ops = gaps["completion_overhead"]
        assert ops["prefetch"]["ops"] == 1
        assert disk["hits"] >= BLOCKS  # read in a few batches (one per reader), not one call per block
        assert 1 <= ops["disk_read"]["ops"] <= 4 < BLOCKS
        assert ops["disk_write"]["ops"] >= 0  # flush() writes directly, outside the chain's write path
        for op in ("prefetch", "disk_read"):
            assert ops[op]["issue_to_done_s"]["sum"] >= ops[op]["transfer_s"]["sum"] > 0
            assert 0 <= ops[op]["overhead_share"] < 1

        # 4: blocks reused on each tier, lifetimes of the ones that left
        life = gaps["block_life"]
        assert life["host"]["reuse_distance"]["count"] == 2 * BLOCKS  # promoted, then again on the way up from disk
        assert life["disk"]["reuse_distance"]["count"] == BLOCKS  # read back once
        assert life["host"]["lifetime_s"]["count"] >= BLOCKS  # cleared
        assert life["device"]["lifetime_s"]["count"] == stats["prefix_cache"]["evictions"]
        assert life["device"]["tracked_blocks"] == stats["cached_blocks"]

        # 5: the two lower-tier loads were measured against their slack
        slack = gaps["prefetch_slack"]
        assert slack["loads"] == 2 and slack["slack_s"]["count"] == requests
        assert gaps["remote_access"] == {"attached": False}
    finally:
        core.close()


def test_remote_access_pattern_counts_batches_and_the_read_write_mix(
        tiny_model_dir: Path, tmp_path: Path, redis_url: str) -> None:
    a = prompt(23)
    first = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv1"), remote_cache_url=redis_url)
    try:
        run(first, "a1", a)
        assert first.chain.drain_writes(30)
        access = _gaps(first)["remote_access"]
        assert access["blocks"]["put"] >= BLOCKS and access["read_share"] == 0.0
        assert access["batch_blocks"]["put"]["count"] == access["ops"]["put"]
        assert _gaps(first)["completion_overhead"]["remote_put"]["ops"] == access["ops"]["put"]
    finally:
        first.close()
    second = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv2"), remote_cache_url=redis_url)
    try:
        assert run(second, "a2", a)[1] == BLOCKS * 4
        gaps = _gaps(second)
        access = gaps["remote_access"]
        assert access["ops"]["exists"] >= 1 and access["blocks"]["get"] >= BLOCKS
        assert access["op_bytes"]["get"]["sum"] >= BLOCKS * second.storage.block_nbytes
        assert gaps["block_life"]["remote"]["tracked_blocks"] >= BLOCKS
        meta = gaps["metadata"]
        assert meta["remote_exists_checks"] >= 1 and meta["by_tier"]["remote"]["metadata_bytes"] > 0
        assert gaps["prefetch_slack"]["loads"] == 1
    finally:
        second.close()


def test_metrics_off_skips_the_detailed_tracking_and_changes_no_output(tiny_model_dir: Path, tmp_path: Path) -> None:
    a = prompt(25)
    outputs = []
    for metrics in (True, False):
        core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / f"kv-{metrics}"), metrics=metrics)
        try:
            outputs.append([run(core, "a1", a), run(core, "a2", a)])
            stats = core.stats()
            tracked = stats["timing"]["ttft_s"]["count"], stats["gaps"]["block_life"]["device"]["tracked_blocks"]
            assert tracked == ((2, stats["cached_blocks"]) if metrics else (0, 0)) and stats["cached_blocks"] > BLOCKS
            assert stats["prefix_cache"]["hit_tokens"] == BLOCKS * 4  # the counters stay on
        finally:
            core.close()
    assert outputs[0] == outputs[1]
