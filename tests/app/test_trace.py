"""Request traces: the ring, the Mooncake export, and `kvgate trace export|replay` against real servers.

The round trip: a scripted workload with known reuse on one server, exported through the CLI and
replayed against a fresh server, gives the same hit rate; a file in the public Mooncake layout
(tests/data/mooncake_sample.jsonl) replays too.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.cli import main as cli_main
from app.trace import TraceRing, export_lines
from app.trace_cli import block_token_ids, blocks_mismatch, read_trace, synthesize
from tests.app.conftest import KVGATE, ROOT, AppServer

SAMPLE = ROOT / "tests" / "data" / "mooncake_sample.jsonl"
FIELDS = ["timestamp", "input_length", "output_length", "hash_ids"]
SALT_A, SALT_B = b"a" * 32, b"b" * 32


def _tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 1000) for _ in range(count)]


def _export(ring: TraceRing, block_tokens: int = 512) -> list[dict]:
    return [json.loads(line) for line in export_lines(ring.snapshot(), ring.granularity, block_tokens)]


# ------------------------------------------------------------------ the ring and the export


def test_ring_keeps_the_most_recent_records_within_both_bounds() -> None:
    ring = TraceRing(block_size=16, capacity=3)
    for i in range(5):
        ring.record(float(i), SALT_A, None, _tokens(i, 40), output_length=i)
    assert len(ring) == 3 and ring.capacity == 3 and ring.dropped == 2
    assert [r.output_length for r in ring.snapshot()] == [2, 3, 4]
    assert [r.output_length for r in ring.snapshot(limit=2)] == [3, 4]
    small = TraceRing(block_size=16, capacity=100, max_hash_bytes=8 * 10)  # 10 fine hashes
    for i in range(4):
        small.record(float(i), SALT_A, None, _tokens(i, 64), output_length=i)  # 4 hashes each
    assert len(small) == 2 and [r.output_length for r in small.snapshot()] == [2, 3]


def test_export_is_the_mooncake_layout_in_arrival_order() -> None:
    ring = TraceRing(block_size=16)
    ring.record(10.5, SALT_A, None, _tokens(1, 1300), output_length=7)
    ring.record(10.0, SALT_A, None, _tokens(2, 512), output_length=3)  # finished later, arrived first
    lines = export_lines(ring.snapshot(), ring.granularity)
    assert all(list(json.loads(line)) == FIELDS for line in lines)
    first, second = (json.loads(line) for line in lines)
    assert first == {"timestamp": 0, "input_length": 512, "output_length": 3, "hash_ids": [0]}
    assert second == {"timestamp": 500, "input_length": 1300, "output_length": 7, "hash_ids": [1, 2, 3]}


def test_hash_ids_preserve_exactly_the_sharing_the_cache_sees() -> None:
    ring = TraceRing(block_size=16)
    system = _tokens(0, 600)
    ring.record(0.0, SALT_A, None, system + _tokens(1, 500), 1)   # 1100 tokens: 3 blocks of 512
    ring.record(1.0, SALT_A, None, system + _tokens(1, 500), 1)   # the same prompt
    ring.record(2.0, SALT_A, None, system + _tokens(2, 500), 1)   # the same first 600 tokens
    ring.record(3.0, SALT_B, None, system + _tokens(1, 500), 1)   # same prompt, another namespace
    ring.record(4.0, SALT_A, "x", system + _tokens(1, 500), 1)    # same prompt, another cache_salt
    same, again, prefix, other_tenant, salted = (r["hash_ids"] for r in _export(ring))
    assert same == again == [0, 1, 2]
    assert prefix[0] == same[0] and prefix[1:] == [3, 4]  # block 1 (tokens 512..1023) differs after 600
    assert not set(other_tenant) & set(same) and not set(salted) & set(same)
    assert not set(other_tenant) & set(salted)
    fine = [r["hash_ids"] for r in _export(ring, block_tokens=16)]
    assert len(fine[0]) == math.ceil(1100 / 16)
    assert fine[2][:37] == fine[0][:37] and fine[2][37] != fine[0][37]  # 37 full 16-token blocks shared


def test_partial_last_block_is_hashed_too() -> None:
    ring = TraceRing(block_size=16)
    prompt = _tokens(5, 40)
    ring.record(0.0, SALT_A, None, prompt, 1)
    ring.record(0.1, SALT_A, None, prompt + [123], 1)
    short, longer = (r["hash_ids"] for r in _export(ring, block_tokens=16))
    assert len(short) == len(longer) == 3
    assert short[:2] == longer[:2] and short[2] != longer[2]


def test_export_holds_no_token_ids() -> None:
    ring = TraceRing(block_size=16)
    secret = [987_654 + i for i in range(100)]
    ring.record(0.0, SALT_A, "tenant-cache-salt", secret, 2)
    text = "\n".join(export_lines(ring.snapshot(), ring.granularity, 16))
    assert "987654" not in text and "tenant-cache-salt" not in text
    assert json.loads(text) == {"timestamp": 0, "input_length": 100, "output_length": 2,
                                "hash_ids": [0, 1, 2, 3, 4, 5, 6]}


def test_block_tokens_must_be_a_multiple_of_the_granularity() -> None:
    ring = TraceRing(block_size=16)
    assert ring.check_block_tokens(512) is None and ring.check_block_tokens(16) is None
    assert "multiple of 16" in (ring.check_block_tokens(24) or "")
    assert TraceRing(block_size=48).granularity == 16


def test_synthetic_prompts_share_exactly_the_traced_blocks() -> None:
    lines = read_trace(str(SAMPLE))
    assert len(lines) == 20 and all(len(line.hash_ids) == math.ceil(line.input_length / 512) for line in lines)
    assert block_token_ids(7, 16) == block_token_ids(7, 16) != block_token_ids(8, 16)
    assert block_token_ids(7, 16, seed=1) != block_token_ids(7, 16)  # --seed: a cold replay
    assert blocks_mismatch(lines, 512) == 0 and blocks_mismatch(lines, 16) == 20  # the wrong --block-tokens
    first, second = (synthesize(line, i, 512, line.input_length) for i, line in enumerate(lines[:2]))
    assert first[:512] == second[:512] and first[512:1024] != second[512:1024]  # both start with id 0
    assert len(first) == lines[0].input_length


# ------------------------------------------------------------------ CLI errors


def test_replay_errors_are_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert cli_main(["trace", "replay", str(missing), "--url", "http://127.0.0.1:9"]) == 2
    assert f"cannot read {missing}: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(SAMPLE.read_text().splitlines()[0] + "\n{\"timestamp\": 5,\n")
    assert cli_main(["trace", "replay", str(bad), "--url", "http://127.0.0.1:9"]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n')
    assert cli_main(["trace", "replay", str(bad), "--url", "http://127.0.0.1:9"]) == 2
    assert f"{bad}:1: missing hash_ids" in capsys.readouterr().err
    assert cli_main(["trace", "replay", str(SAMPLE), "--url", "http://127.0.0.1:9", "--speed", "-1"]) == 2
    assert "--speed must be" in capsys.readouterr().err


def test_unreachable_server_is_one_line(tmp_path: Path) -> None:
    """Through the installed `kvgate` script: exit status 1 and what to do."""
    for args in (["replay", str(SAMPLE)], ["export", "--out", str(tmp_path / "t.jsonl")]):
        result = subprocess.run([KVGATE, "trace", *args, "--url", "http://127.0.0.1:9"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 1, result.stderr
        assert "cannot reach the server at http://127.0.0.1:9" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.jsonl").exists()


# ------------------------------------------------------------------ real servers


@pytest.fixture(scope="module")
def servers(start_app) -> Iterator[tuple[AppServer, AppServer]]:
    """Two fresh tiny servers (their traces hold only this module's requests), in this process:
    the `kvgate trace` CLI reaches them over HTTP; `start_app` stops them after the module."""
    yield start_app("--model", "tiny"), start_app("--model", "tiny")


def _workload(url: str) -> tuple[float, int]:
    """Sequential requests with known reuse; returns the server's hit rate and the request count."""
    system = _tokens(0, 300)
    bodies: list[dict] = []
    for i in range(4):  # a shared 300-token system prompt, then each user's own text
        bodies.append({"prompt": system + _tokens(10 + i, 40 + 7 * i)})
    bodies.append({"prompt": system + _tokens(10, 40)})  # user 0 again, word for word
    bodies.append({"prompt": system + _tokens(10, 40), "cache_salt": "private"})  # not shared
    bodies.append({"prompt": [system[:200] + _tokens(20, 30), _tokens(21, 90)]})  # two prompts, one call
    bodies.append({"prompt": _tokens(21, 90) + _tokens(22, 50), "n": 2})
    bodies.append({"messages": [{"role": "system", "content": "You answer briefly. " * 8},
                                {"role": "user", "content": "What is a KV cache?"}]})
    bodies.append({"messages": [{"role": "system", "content": "You answer briefly. " * 8},
                                {"role": "user", "content": "And a prefix cache?"}]})
    prompt_tokens = cached_tokens = 0
    requests = 0
    with httpx.Client(base_url=url, timeout=60) as client:
        for body in bodies:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            response = client.post(path, json={"model": "tiny", "max_tokens": 5, "ignore_eos": True, **body})
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            prompt_tokens += usage["prompt_tokens"]
            cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            requests += len(body["prompt"]) if isinstance(body.get("prompt", [0])[0], list) else 1
    assert 0 < cached_tokens < prompt_tokens
    return cached_tokens / prompt_tokens, requests


def _kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVGATE, "trace", *args], capture_output=True, text=True, timeout=120)


def test_exported_trace_replays_with_the_same_hit_rate(servers, tmp_path: Path) -> None:
    first, fresh = servers
    hit_rate, requests = _workload(first.url)

    response = httpx.get(first.url + "/admin/trace", params={"block_tokens": 16}, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-ndjson"
    assert response.headers["x-kvgate-block-tokens"] == "16"
    records = [json.loads(line) for line in response.text.splitlines()]
    assert len(records) == requests and all(list(r) == FIELDS for r in records)
    assert all(r["output_length"] == 5 for r in records)  # ignore_eos: every choice ran to max_tokens
    assert records[0]["timestamp"] == 0 and [r["timestamp"] for r in records] == sorted(r["timestamp"] for r in records)

    default = _kvgate("export", "--url", first.url, "--out", str(tmp_path / "t512.jsonl"))
    assert default.returncode == 0, default.stderr
    assert f"wrote {requests} requests" in default.stderr and "block_tokens=512" in default.stderr
    for record in map(json.loads, (tmp_path / "t512.jsonl").read_text().splitlines()):
        assert len(record["hash_ids"]) == math.ceil(record["input_length"] / 512)

    exported = _kvgate("export", "--url", first.url + "/v1", "--out", str(tmp_path / "t16.jsonl"),
                       "--block-tokens", "16")
    assert exported.returncode == 0, exported.stderr
    assert "--block-tokens 16" in exported.stderr
    replayed = _kvgate("replay", str(tmp_path / "t16.jsonl"), "--url", fresh.url, "--block-tokens", "16",
                       "--speed", "0", "--concurrency", "1", "--json")
    assert replayed.returncode == 0, replayed.stderr
    summary = json.loads(replayed.stdout)
    assert summary["requests"] == requests and summary["failures"] == 0
    assert summary["hit_rate"] == pytest.approx(hit_rate, abs=0.02), (summary, hit_rate)
    assert f"replay: {requests}/{requests} requests done" in replayed.stderr  # plain progress off a terminal


def test_public_mooncake_file_replays(servers) -> None:
    first, _ = servers
    result = _kvgate("replay", str(SAMPLE), "--url", first.url, "--speed", "100", "--concurrency", "1",
                     "--max-output-tokens", "4")
    assert result.returncode == 0, result.stderr
    table = {line[:14].strip(): line[15:] for line in result.stdout.splitlines()}
    assert table["requests"] == "20" and table["failures"] == "0" and table["clipped"] == "1"
    assert float(table["hit rate"].rstrip(" %")) > 0  # every request shares block 0, sessions more
    assert table["TTFT p50"].endswith(" ms") and table["TTFT p99"].endswith(" ms")
    assert "1 of 20 prompts did not fit the server's context (4096 tokens)" in result.stderr
