"""cache.archetype: a table of configurations → archetype and axes, the description built from a
real TierChain's snapshot (and how it follows attach, detach and a tripped breaker), and a
property check that every combination of flags gets one of the five names and a reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cache.archetype import (
    ARCHETYPES,
    CENTRAL_OWNED,
    ENGINE_OWNED,
    SHARED_OWNED,
    HierarchyView,
    TierView,
    classify,
    describe,
)
from cache.tiers.chain import TierChain
from cache.tiers.codec import BlockFormat
from cache.tiers.disk import DiskTier
from cache.tiers.host import HostTier
from cache.tiers.remote import RemoteTier

MAC_KEY = bytes(range(100, 132))  # the store key every replica of a test deployment shares

FMT = BlockFormat(bytes(range(32)), "float16", (4, 8))  # 64-byte blocks
NB = FMT.payload_size
DEAD_REDIS = "redis://127.0.0.1:1/0"  # never connected to: the tests drive the breaker directly


KINDS = {"host": HostTier, "disk": DiskTier, "remote": RemoteTier}


def tier_view(name: str, healthy: bool = True, **fields: Any) -> TierView:
    """A view of a tier of kind ``name``, with the traits that kind declares."""
    traits = KINDS[name].traits
    return TierView(name, enabled=True, healthy=healthy, locality=traits.locality, lifetime=traits.lifetime,
                    substrate=traits.substrate, shared=traits.shared, **fields)


def view(device: str = "cuda", caching: bool = True, host: bool | None = None, disk: bool | None = None,
         remote: bool | None = None, breaker: str = "open", remote_cluster: bool = False,
         **flags: bool) -> HierarchyView:
    """None: tier absent; True: attached and healthy; False: attached and down."""
    tiers = []
    for name, state in (("host", host), ("disk", disk), ("remote", remote)):
        if state is not None:
            detail = {"breaker": "closed" if state else breaker} if name == "remote" else {}
            label = "remote Redis Cluster" if name == "remote" and remote_cluster else ""
            tiers.append(tier_view(name, healthy=state, detail=detail, label=label))
    return HierarchyView(device, caching, tuple(tiers), **flags)  # type: ignore[arg-type]


HBM, RAM, DRAM, NVME, NET = "gpu-hbm", "cpu-ram", "host-dram", "nvme-fs", "network"

# (id, view, name, locality, longest lifetime, ownership, substrate)
TABLE = [
    ("device-only-cuda", view(), "Local-Paged", ["device"], "session", ENGINE_OWNED, [HBM]),
    ("device-only-cpu", view("cpu"), "Local-Paged", ["device"], "session", ENGINE_OWNED, [RAM]),
    ("no-prefix-caching", view(caching=False), "Local-Paged", ["device"], "request", ENGINE_OWNED, [HBM]),
    ("no-prefix-caching-tiers-inert", view(caching=False, host=True, disk=True, remote=True),
     "Local-Paged", ["device"], "request", ENGINE_OWNED, [HBM]),
    ("kvgate-default-cuda", view(host=True, disk=True), "Hybrid-Tier",
     ["device", "host", "node-ssd"], "persistent", ENGINE_OWNED, [HBM, DRAM, NVME]),
    ("kvgate-default-cpu", view("cpu", host=True, disk=True), "Hybrid-Tier",
     ["device", "host", "node-ssd"], "persistent", ENGINE_OWNED, [RAM, DRAM, NVME]),
    ("host-only", view(host=True), "Hybrid-Tier", ["device", "host"], "session", ENGINE_OWNED, [HBM, DRAM]),
    ("disk-only", view("cpu", disk=True), "Hybrid-Tier", ["device", "node-ssd"], "persistent",
     ENGINE_OWNED, [RAM, NVME]),
    ("default-plus-redis", view(host=True, disk=True, remote=True), "Hybrid-Tier",
     ["device", "host", "node-ssd", "remote"], "persistent", SHARED_OWNED, [HBM, DRAM, NVME, NET]),
    ("default-redis-down", view(host=True, disk=True, remote=False), "Hybrid-Tier",
     ["device", "host", "node-ssd"], "persistent", ENGINE_OWNED, [HBM, DRAM, NVME]),
    ("remote-only", view(remote=True), "Shared-Store", ["device", "remote"], "persistent", SHARED_OWNED,
     [HBM, NET]),
    ("remote-cluster", view(remote=True, remote_cluster=True), "Shared-Store", ["device", "remote"],
     "persistent", SHARED_OWNED, [HBM, NET]),
    ("remote-only-down", view(remote=False), "Local-Paged", ["device"], "session", ENGINE_OWNED, [HBM]),
    ("remote-half-open", view(remote=False, breaker="half-open"), "Local-Paged", ["device"], "session",
     ENGINE_OWNED, [HBM]),
    ("host-down", view(host=False, disk=True), "Hybrid-Tier", ["device", "node-ssd"], "persistent",
     ENGINE_OWNED, [HBM, NVME]),
    ("disaggregated", view(disaggregated=True), "Disaggregated-Pipeline", ["device"], "session",
     ENGINE_OWNED, [HBM, NET]),
    ("disaggregated-with-host", view(host=True, disaggregated=True), "Disaggregated-Pipeline",
     ["device", "host"], "session", ENGINE_OWNED, [HBM, DRAM, NET]),
    ("central-manager", view(host=True, remote=True, central_manager=True), "Memory-Pool",
     ["device", "host", "remote"], "persistent", CENTRAL_OWNED, [HBM, DRAM, NET]),
    ("disaggregated-and-central", view(remote=True, disaggregated=True, central_manager=True),
     "Disaggregated-Pipeline", ["device", "remote"], "persistent", CENTRAL_OWNED, [HBM, NET]),
]


@pytest.mark.parametrize(("config", "name", "locality", "lifetime", "ownership", "substrate"),
                         [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_configuration_table(config: HierarchyView, name: str, locality: list[str], lifetime: str,
                             ownership: str, substrate: list[str]) -> None:
    got = classify(config).to_dict()
    assert got["name"] == name, got["reason"]
    axes = got["axes"]
    assert axes["locality"] == locality
    assert axes["lifetime"]["longest"] == lifetime
    assert axes["ownership"] == ownership
    assert axes["substrate"] == substrate
    assert set(axes["lifetime"]["per_tier"]) == {t for t, r in got["tiers"].items() if r["active"]}
    assert list(got["tiers"]) == ["device"] + [t.name for t in config.tiers[1:]]  # attached ones, top down
    json.dumps(got)  # JSON as is


def test_the_table_covers_all_five_archetypes() -> None:
    assert {row[2] for row in TABLE} == set(ARCHETYPES)


def test_reason_names_the_deciding_tiers_and_a_tier_that_is_down() -> None:
    reason = classify(view(host=True, disk=True, remote=False)).reason
    assert reason.startswith("remote tier configured but unreachable (circuit open): "
                             "serving as Hybrid-Tier on device, host and disk")
    assert "remote" not in classify(view(host=True, disk=True)).reason
    assert "Redis Cluster" in classify(view(remote=True, remote_cluster=True)).reason
    assert "circuit half-open" in classify(view(remote=False, breaker="half-open")).reason
    assert "host tier configured but down" in classify(view(host=False)).reason
    assert "attached but inert (prefix caching off)" in classify(view(caching=False, disk=True)).reason


def test_down_and_inert_tiers_are_reported_but_not_decisive() -> None:
    tiers = classify(view(host=True, remote=False)).tiers
    assert tiers["remote"].enabled and not tiers["remote"].healthy and not tiers["remote"].active
    assert tiers["remote"].substrate == NET and tiers["remote"].lifetime == "persistent"
    assert "disk" not in tiers  # not attached: not listed
    inert = classify(view(caching=False, host=True)).tiers["host"]
    assert inert.enabled and inert.healthy and not inert.active


def test_invalid_views_are_refused() -> None:
    with pytest.raises(ValueError):
        HierarchyView("tpu", True)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TierView("", True)
    with pytest.raises(ValueError):
        TierView("ssd", True, lifetime="forever")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        HierarchyView("cpu", True, (TierView("host", True), TierView("host", True)))
    with pytest.raises(ValueError):
        HierarchyView("cpu", True, (TierView("device", True, healthy=False),))
    with pytest.raises(ValueError):
        describe("mps", True, {})


# ---- from a real TierChain --------------------------------------------------------------------


@pytest.fixture
def chains() -> Iterator[list[TierChain]]:
    made: list[TierChain] = []
    try:
        yield made
    finally:
        for chain in made:
            chain.close()


def test_describe_follows_a_real_chain_through_detach_and_attach(tmp_path: Path,
                                                                 chains: list[TierChain]) -> None:
    chains.append(chain := TierChain([HostTier(4 * NB, NB), DiskTier(tmp_path / "disk", 8 * FMT.record_size, FMT)]))
    chain.demote(bytes(32), torch.zeros(NB, dtype=torch.uint8))

    def now(device: str = "cuda:0") -> dict:
        return classify(describe(device, True, chain.snapshot())).to_dict()

    first = now()
    assert first["name"] == "Hybrid-Tier"
    assert first["axes"]["locality"] == ["device", "host", "node-ssd"]
    assert first["tiers"]["host"]["capacity_bytes"] == 4 * NB  # derived: a block is in host
    assert first["tiers"]["disk"]["detail"]["path"] == str(chain.store.dir)  # type: ignore[union-attr]
    assert now("cpu")["axes"]["substrate"] == [RAM, DRAM, NVME]

    chain.detach("disk")
    assert now()["axes"]["locality"] == ["device", "host"]
    chain.detach("host")
    assert now()["name"] == "Local-Paged" and "host" not in now()["tiers"]

    chain.attach(RemoteTier(DEAD_REDIS, FMT, open_s=60.0, mac_key=MAC_KEY))
    shared = now()
    assert shared["name"] == "Shared-Store" and shared["axes"]["ownership"] == SHARED_OWNED
    assert shared["tiers"]["remote"]["capacity_bytes"] is None  # bounded by Redis, not KVGate

    assert chain.shared is not None
    for _ in range(chain.shared.breaker.failures_to_open):  # what three timed-out pipelines do
        chain.shared.breaker.failure()
    tripped = now()
    assert tripped["name"] == "Local-Paged"
    assert tripped["reason"].startswith("remote tier configured but unreachable (circuit open)")
    assert tripped["tiers"]["remote"]["detail"]["breaker_trips"] == 1
    chain.shared.breaker.success()  # a probe got through
    assert now()["name"] == "Shared-Store"


def test_describe_reads_half_open_and_cluster(tmp_path: Path, chains: list[TierChain]) -> None:
    chains.append(chain := TierChain([HostTier(4 * NB, NB), RemoteTier(DEAD_REDIS, FMT, open_s=0.0, mac_key=MAC_KEY)]))
    assert chain.shared is not None
    for _ in range(chain.shared.breaker.failures_to_open):
        chain.shared.breaker.failure()
    chain.shared.cluster = True  # (how a Redis Cluster store describes itself; never connected to here)
    got = classify(describe("cuda", True, chain.snapshot())).to_dict()
    assert got["name"] == "Hybrid-Tier" and got["axes"]["ownership"] == ENGINE_OWNED
    assert "circuit half-open" in got["reason"]
    assert got["tiers"]["remote"]["detail"]["cluster"] is True
    assert got["tiers"]["host"]["capacity_bytes"] is None  # nothing in host yet: size unknown
    sized = describe("cuda", True, chain.snapshot(), capacity_bytes={"host": 4 * NB, "device": 1 << 20})
    assert sized.tier("host").capacity_bytes == 4 * NB and sized.tier("device").capacity_bytes == 1 << 20


def test_describe_without_a_chain() -> None:
    assert classify(describe("cpu", True, {})).name == "Local-Paged"
    assert classify(describe("cpu", False, None)).axes.lifetime == "request"


# ---- property: total over every combination of flags -----------------------------------------

_tier_state = st.sampled_from([None, "healthy", "down"])
_breaker = st.sampled_from(["closed", "open", "half-open"])


@given(device=st.sampled_from(["cpu", "cuda", "cuda:1"]), caching=st.booleans(), host=_tier_state,
       disk=_tier_state, remote=st.one_of(st.none(), _breaker), cluster=st.booleans(),
       disaggregated=st.booleans(), central=st.booleans())
def test_classify_is_total(device: str, caching: bool, host: str | None, disk: str | None,
                           remote: str | None, cluster: bool, disaggregated: bool, central: bool) -> None:
    stats: dict[str, dict] = {"chain": {"demotions": 0}}
    for name, state in (("host", host), ("disk", disk)):
        if state is not None:
            stats[name] = {"blocks": 0, "capacity_blocks": 4, "bytes": 0, "traits": KINDS[name].traits.to_dict(),
                           "healthy": state == "healthy"}
    if remote is not None:
        stats["remote"] = {"blocks": 0, "capacity_blocks": 0, "bytes": 0, "breaker": remote,
                           "traits": RemoteTier.traits.to_dict(), "cluster": cluster,
                           "label": "remote Redis Cluster" if cluster else ""}
    config = describe(device, caching, stats, disaggregated=disaggregated, central_manager=central)

    got = classify(config)
    assert got.name in ARCHETYPES and got.reason.strip()
    assert got == classify(config)  # a function of the view alone
    json.dumps(got.to_dict())
    active = [n for n, r in got.tiers.items() if r.active]
    assert active[0] == "device" and got.axes.locality[0] == "device"
    assert len(got.axes.locality) == len(active)
    for name, report in got.tiers.items():
        if report.enabled and not report.active:
            assert name in got.reason  # a tier left out is always named
        if report.active:
            assert report.enabled and report.healthy
    if disaggregated:
        assert got.name == "Disaggregated-Pipeline"
    elif central:
        assert got.name == "Memory-Pool"
    assert (got.axes.ownership == CENTRAL_OWNED) == central
    if not caching:
        assert active == ["device"] and got.axes.lifetime == "request"
