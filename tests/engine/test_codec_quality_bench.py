"""bench.codec_quality on the tiny model, few positions: the lossless codec measures as lossless,
the lossy ones as small and ordered by their precision, and the JSON carries every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import codec_quality
from cache.tiers.kv_codec import CODECS

FIGURES = ("bytes_per_value", "block_bytes", "positions", "top1_agreement", "top1_disagreements", "mean_kl",
           "median_kl", "p99_kl", "max_kl", "mean_nll_none", "mean_nll_delta", "max_abs_value_error",
           "greedy_identical", "greedy_prompts", "greedy", "kl_quantiles", "by_prefix")


@pytest.fixture(scope="module")
def result(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One small run of the whole bench (all four codecs): its JSON and its plot's path."""
    out = tmp_path_factory.mktemp("codec_quality")
    argv = ["--model", str(tiny_model_dir), "--positions", "64", "--prefixes", "32,64", "--continuation", "16",
            "--greedy-prompts", "2", "--greedy-context", "32", "--greedy-tokens", "4", "--threads", "1",
            "--json-out", str(out / "q.json"), "--plot-out", str(out / "q.png")]
    threads = torch.get_num_threads()
    try:  # one thread: the tiny model's ops are too small to share, and a busy machine slows a team
        assert codec_quality.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "q.json").read_text()), out / "q.png"


def test_none_is_lossless(result: tuple[dict, Path]) -> None:
    none = result[0]["codecs"]["none"]
    assert none["positions"] >= 64
    assert none["top1_agreement"] == 1.0 and none["top1_disagreements"] == 0
    assert none["mean_kl"] == 0.0 and none["max_kl"] == 0.0 and none["mean_nll_delta"] == 0.0
    assert none["max_abs_value_error"] == 0.0
    assert none["greedy_identical"] == none["greedy_prompts"] == 2


def test_lossy_codecs_cost_little_and_in_order_of_precision(result: tuple[dict, Path]) -> None:
    codecs = result[0]["codecs"]
    bf16, fp16, int8 = codecs["bf16"], codecs["fp16"], codecs["int8"]
    for c in (bf16, fp16, int8):
        assert 0.0 < c["mean_kl"] <= c["max_kl"] < 0.05
        assert c["top1_agreement"] >= 0.9
        assert c["max_abs_value_error"] > 0.0
    assert fp16["mean_kl"] < bf16["mean_kl"] <= int8["mean_kl"]  # 11, 8 and ~7 bits of precision


def test_greedy_runs_load_their_prefix_from_the_encoded_disk_records(result: tuple[dict, Path]) -> None:
    for codec, c in result[0]["codecs"].items():
        assert len(c["greedy"]) == 2, codec
        for row in c["greedy"]:
            assert row["cached_tokens"] >= 32 and row["disk_hits"] >= 2, (codec, row)
            assert len(row["cold"]) == len(row["warm"]) == 4
            assert row["identical"] == (row["cold"] == row["warm"])


def test_json_has_every_field_and_the_plot_is_written(result: tuple[dict, Path]) -> None:
    out, png = result
    assert list(out["codecs"]) == list(CODECS)
    for codec, c in out["codecs"].items():
        assert set(FIGURES) <= set(c), codec
        assert set(c["by_prefix"]) == {"32", "64"}, codec
        assert sum(g["positions"] for g in c["by_prefix"].values()) == c["positions"], codec
    sizes = {codec: c["bytes_per_value"] for codec, c in out["codecs"].items()}
    assert sizes["none"] == 4 and sizes["bf16"] == sizes["fp16"] == 2 and 1 < sizes["int8"] < 1.1
    assert {"model", "method", "machine", "args", "documents", "windows", "wall_s"} <= set(out)
    assert out["model"]["block_shape"] == [2, 2, 16, 2, 16]  # the tiny model: 2 layers, 2 kv heads of 16
    assert sum(w["continuation"] for w in out["windows"]) == out["codecs"]["none"]["positions"]
    assert "| codec | bytes/value | top-1 agreement |" in codec_quality.table(out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_blocks_round_trip_through_the_engine_layout() -> None:
    layers = [(torch.randn(1, 2, 48, 8), torch.randn(1, 2, 48, 8)) for _ in range(3)]
    blocks = codec_quality.cache_to_blocks(layers, 16)
    assert blocks.shape == (3, 3, 2, 16, 2, 8)
    assert torch.equal(blocks[1, 2, 1, 5], layers[2][1][0, :, 16 + 5])  # block 1, layer 2, V, token 21
    cache = codec_quality.blocks_to_cache(blocks)
    assert all(torch.equal(cache.layers[i].keys, k) and torch.equal(cache.layers[i].values, v)
               for i, (k, v) in enumerate(layers))
    assert torch.equal(codec_quality.round_trip("none", blocks[0]), blocks[0])
    assert not torch.equal(codec_quality.round_trip("int8", blocks[0]), blocks[0])
