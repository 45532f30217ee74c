"""The engine's stats schema: what `stats()` returns is exactly `EngineSnapshot`'s fields (each
tier entry `TierSnapshot`'s, flattened), and docs/metrics.md holds the generated schema."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from cache.tiers.base import TierSnapshot
from cache.tiers.stats import TierStats
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.snapshot import EngineSnapshot, PrefixCacheSnapshot, schema_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_stats_have_exactly_the_schemas_fields(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = EngineCore(EngineConfig(model=str(tiny_model_dir), num_blocks=32, host_cache_mb=1,
                                   disk_cache_path=str(tmp_path / "kv")))
    try:
        stats = core.stats()
        assert list(stats) == [f.name for f in fields(EngineSnapshot)]
        assert list(stats["prefix_cache"]) == [f.name for f in fields(PrefixCacheSnapshot)]
        tiers = stats["tiers"]
        assert list(tiers) == ["chain", "host", "disk"]
        common = [f.name for f in fields(TierSnapshot) if f.name not in ("counters", "detail")]
        for name in ("host", "disk"):
            entry = tiers[name]
            assert set(entry) >= {f.name for f in fields(TierStats)} | set(common)
            detail = set(entry) - {f.name for f in fields(TierStats)} - set(common)
            assert detail == set(core.chain.tier(name).describe())  # the rest is what the tier describes
    finally:
        core.close()


def test_docs_hold_the_generated_schema() -> None:
    text = DOCS.read_text()
    begin, end = text.index("<!-- schema:begin -->\n"), text.index("<!-- schema:end -->")
    assert text[begin + len("<!-- schema:begin -->\n"):end] == schema_markdown(), \
        "docs/metrics.md is stale: paste the output of `python -m engine.snapshot` between the markers"
