"""A kind of tier defined here, in the test, registered with `cache.tiers.factory` and nothing
else: attached over `POST /admin/tiers`, it takes blocks and serves a prefix like the built-in
tiers, and shows up in `/admin/tiers`, `/admin/metrics`, the archetype, Prometheus and the
dashboard's list of kinds. Nothing in the chain, the archetype, the admin routes or Prometheus
knows its name.

The app runs in process (the engine on a thread), since the kind is registered in this process.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, Field

from app.main import create_app
from app.settings import load_settings
from cache.quota import UNKNOWN, QuotaLedger
from cache.telemetry import BlockLife
from cache.tiers import factory
from cache.tiers.base import StoreTier, TierTraits
from cache.tiers.codec import BlockFormat
from cache.tiers.stats import RateEstimate, TierStats
from engine.async_engine import AsyncEngine

CONFIG = """
[model]
path = "tiny"

[cache]
block_size = 16

[cache.device]
num_blocks = 48

[cache.host]
capacity_mb = 8

[cache.disk]
capacity_mb = 0
"""


class ScratchStore:
    """A store tier in a dict: blocks in this process's memory, first in, first out."""

    name = "scratch"
    traits = TierTraits(locality="host", lifetime="session", substrate="host-dram", shared=False, role="store")
    policy_name = "fifo"
    load_timeout_s = 1.0

    def __init__(self, fmt: BlockFormat, capacity_blocks: int) -> None:
        self.fmt = fmt
        self.capacity_blocks = capacity_blocks
        self.stats = TierStats()
        self.rate = RateEstimate(bytes_per_s=1e9, latency_s=1e-4)
        self.life = BlockLife()
        self.ledger = QuotaLedger(capacity_blocks)
        self.blocks: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blocks.values())

    def describe(self) -> dict[str, Any]:
        return {"note": "in-test tier"}

    def apply_quota(self, owner: str, tag: str, blocks: int | None) -> None:
        self.ledger.set_limit(owner, blocks)

    def touch(self, key: bytes) -> bool:
        return key in self.blocks

    def delete(self, key: bytes) -> bool:
        return self.blocks.pop(key, None) is not None

    def health(self) -> str | None:
        return None

    def note_stall(self, blocks: int) -> None:
        self.stats.timeouts += blocks

    async def read_many(self, keys: Sequence[bytes], into: Sequence[memoryview | None] | None = None
                        ) -> list[memoryview | None]:
        out: list[memoryview | None] = []
        for i, key in enumerate(keys):
            data = self.blocks.get(key)
            if data is None:
                self.stats.misses += 1
                out.append(None)
                continue
            self.stats.hits += 1
            self.stats.bytes_read += len(data)
            dest = into[i] if into else None
            if dest is not None:
                dest[: len(data)] = data
                out.append(dest[: len(data)])
            else:
                out.append(memoryview(bytearray(data)))
        return out

    async def write(self, key: bytes, payload: bytes | memoryview, owner: str = UNKNOWN,
                    executor: Executor | None = None) -> bool:
        if len(self.blocks) >= self.capacity_blocks:
            oldest = next(iter(self.blocks))
            del self.blocks[oldest]
            self.ledger.remove(oldest)
            self.stats.evictions += 1
        self.blocks[key] = bytes(payload)
        self.ledger.add(key, owner)
        self.stats.puts += 1
        self.stats.bytes_written += len(payload)
        return True


class ScratchOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    capacity_blocks: int = Field(default=64, gt=0)


@pytest.fixture
def scratch_kind() -> Iterator[list[ScratchStore]]:
    made: list[ScratchStore] = []

    def build(options: ScratchOptions, ctx: factory.BuildContext) -> ScratchStore:
        made.append(ScratchStore(ctx.fmt, options.capacity_blocks))
        return made[-1]

    factory.register(factory.TierKind("scratch", ScratchOptions, build,
                                      http_fields=frozenset({"capacity_blocks"})))
    try:
        yield made
    finally:
        factory.unregister("scratch")


@pytest.fixture
def client(tmp_path: Path, scratch_kind: list[ScratchStore], tiny_model_dir: Path) -> Iterator[TestClient]:
    path = tmp_path / "kvgate.toml"
    path.write_text(CONFIG)
    settings = load_settings(path, {"model.path": str(tiny_model_dir)}, env={})
    engine = AsyncEngine.from_config(settings.engine_config(), process=False)
    with TestClient(create_app(settings, engine=engine)) as test_client:
        yield test_client


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _complete(client: TestClient, ids: list[int], max_tokens: int = 8) -> tuple[str, int]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tier_kind_registered_in_a_test_serves_and_shows_everywhere(client: TestClient,
                                                                       scratch_kind: list[ScratchStore]) -> None:
    assert isinstance(ScratchStore(BlockFormat(bytes(32), "float32", (2, 2)), 1), StoreTier)
    assert "scratch" in client.get("/admin/metrics").json()["tier_kinds"]  # the dashboard lists kinds

    bad = client.post("/admin/tiers", json={"action": "attach", "tier": "scratch", "capacity_blocks": 0})
    assert bad.status_code == 400 and "capacity_blocks" in bad.json()["error"]["message"]
    unknown = client.post("/admin/tiers", json={"action": "attach", "tier": "scratch", "path": "/tmp/x"})
    assert unknown.status_code == 400 and "unknown option" in unknown.json()["error"]["message"]
    attach = client.post("/admin/tiers", json={"action": "attach", "tier": "scratch", "capacity_blocks": 256})
    assert attach.status_code == 200, attach.text
    assert attach.json() == {"ok": True, "action": "attach", "tier": "scratch", "healthy": True,
                             "capacity_blocks": 256}
    assert list(client.get("/admin/tiers").json()["tiers"]) == ["chain", "host", "scratch"]

    prompt = _ids(1, 500)  # 31 full blocks of the 48-block pool
    cold, cached = _complete(client, prompt)
    assert cached == 0
    for seed in (2, 3):  # two other long prompts push it off the device, into host
        _complete(client, _ids(seed, 600), max_tokens=1)
    detach = client.post("/admin/tiers", json={"action": "detach", "tier": "host"})  # host is written down first
    assert detach.status_code == 200, detach.text
    (store,) = scratch_kind
    assert len(store) >= 31

    warm, cached = _complete(client, prompt)  # from the scratch tier, through no host tier
    assert warm == cold and cached == 496
    assert store.stats.hits >= 31

    metrics = client.get("/admin/metrics").json()
    entry = metrics["tiers"]["scratch"]
    assert entry["traits"] == store.traits.to_dict() and entry["note"] == "in-test tier"
    assert entry["hits"] == store.stats.hits and entry["capacity_blocks"] == 256
    archetype = client.get("/admin/archetype").json()
    assert archetype["name"] == "Hybrid-Tier" and "scratch below the device" in archetype["reason"]
    assert archetype["axes"]["locality"] == ["device", "host"]  # (the locality it declares)
    assert archetype["tiers"]["scratch"]["active"] and archetype["tiers"]["scratch"]["substrate"] == "host-dram"
    prometheus = client.get("/metrics").text
    assert f'kvgate_tier_hits_total{{tier="scratch"}} {float(store.stats.hits)}' in prometheus
    assert 'kvgate_tier_up{tier="scratch"} 1.0' in prometheus

    detach = client.post("/admin/tiers", json={"action": "detach", "tier": "scratch"})
    assert detach.status_code == 200, detach.text
    assert "scratch" not in client.get("/admin/metrics").json()["tiers"]
    assert client.get("/admin/archetype").json()["name"] == "Local-Paged"
