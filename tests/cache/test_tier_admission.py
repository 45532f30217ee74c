"""Admission by reuse (``admit = "second_use"``) and ``write = "selective"``: which blocks go
below host memory, and when, on a real host tier, disk tier and a private Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cache.tiers.chain import TierChain
from cache.tiers.disk import DiskTier
from cache.tiers.host import HostTier
from cache.tiers.remote import RemoteTier
from tests.cache.test_tier_chain import FMT, MAC_KEY, NB, WAIT_S, block, key

pytestmark = pytest.mark.unit


@pytest.fixture
def chains() -> Iterator[list[TierChain]]:
    made: list[TierChain] = []
    try:
        yield made
    finally:
        for chain in made:
            chain.close()


def host_disk(tmp_path: Path, chains: list[TierChain], host_blocks: int = 2, **kwargs) -> TierChain:
    chain = TierChain([HostTier(host_blocks * NB, NB), DiskTier(tmp_path / "disk", 64 * FMT.record_size, FMT)],
                      **kwargs)
    chains.append(chain)
    return chain


def demote(chain: TierChain, ids: range | list[int]) -> None:
    for i in ids:
        chain.demote(key(i), block(i))
    assert chain.drain_writes(WAIT_S)


def on_disk(chain: TierChain) -> set[int]:
    return {i for i in range(64) if key(i) in chain.store}


def test_always_writes_every_block_that_leaves_host(tmp_path: Path, chains: list[TierChain]) -> None:
    chain = host_disk(tmp_path, chains)
    demote(chain, range(6))
    assert on_disk(chain) == {0, 1, 2, 3} and chain.stats.not_admitted == 0


def test_second_use_writes_only_reused_blocks(tmp_path: Path, chains: list[TierChain]) -> None:
    chain = host_disk(tmp_path, chains, admit="second_use")
    chain.note_reuse(key(1))
    chain.note_reuse(key(3))
    demote(chain, range(6))  # 0..3 leave a 2-block host
    assert on_disk(chain) == {1, 3}
    assert chain.stats.not_admitted == 2 and chain.store.stats.writes == 2
    assert key(0) not in chain.memory and not chain.on_lower_tier(key(0))  # dropped, not kept
    assert chain.snapshot()["chain"]["admit"] == "second_use"


def test_a_block_computed_again_after_being_dropped_is_admitted(tmp_path: Path, chains: list[TierChain]) -> None:
    chain = host_disk(tmp_path, chains, admit="second_use")
    demote(chain, range(4))  # 0 and 1 dropped unwritten
    assert on_disk(chain) == set()
    demote(chain, [0, 10, 11])  # block 0 comes down a second time: a second use
    assert chain.stats.readmitted == 1
    demote(chain, [12, 13])  # pushes 0 out of host again
    assert on_disk(chain) == {0}


def test_second_use_flush_writes_only_admitted_blocks(tmp_path: Path, chains: list[TierChain]) -> None:
    chain = host_disk(tmp_path, chains, host_blocks=4, admit="second_use")
    demote(chain, range(3))
    chain.note_reuse(key(2))
    device = [(key(20), lambda: block(20).numpy().tobytes()), (key(21), lambda: block(21).numpy().tobytes())]
    chain.note_reuse(key(21))
    assert chain.flush(device, WAIT_S) == 2
    assert on_disk(chain) == {2, 21}


def test_second_use_behind_writes_a_host_block_once_reused(tmp_path: Path, chains: list[TierChain]) -> None:
    chain = host_disk(tmp_path, chains, host_blocks=8, persist="behind", admit="second_use")
    demote(chain, range(3))
    assert chain.persist_behind() == 0  # nothing reused yet: nothing to write
    chain.note_reuse(key(1))
    copied = {"n": 0}

    def copy() -> bytes:
        copied["n"] += 1
        return block(1).numpy().tobytes()

    chain.note_computed(key(1), copy)  # the engine offers a block once its reuse is seen
    chain.note_computed(key(2), copy)  # not reused: refused
    assert chain.persist_behind() == 1 and chain.drain_writes(WAIT_S)
    assert on_disk(chain) == {1}


def test_blocked_writes_pass_over_only_admitted_blocks(tmp_path: Path, chains: list[TierChain]) -> None:
    chain = host_disk(tmp_path, chains, admit="second_use", max_pending_writes=1)
    assert not chain._keep_in_host(key(5))  # never reused: evicting it loses nothing it would keep
    chain.note_reuse(key(5))
    chain._pending_writes = 1  # the write bound is reached
    assert chain._keep_in_host(key(5))
    chain._pending_writes = 0


def test_unknown_admit_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="admit must be one of always, second_use"):
        TierChain(admit="sometimes")


@pytest.mark.parametrize("mode", ["back", "selective"])
def test_remote_write_modes_on_leaving_host(tmp_path: Path, chains: list[TierChain], redis_server, redis_url: str,
                                            mode: str) -> None:
    remote = RemoteTier(redis_url, FMT, write_mode=mode, mac_key=MAC_KEY)
    chain = TierChain([HostTier(2 * NB, NB), remote])
    chains.append(chain)
    chain.note_reuse(key(2))
    demote(chain, range(5))  # 0, 1, 2 leave host
    with redis_server.client() as client:
        stored = {int.from_bytes(bytes.fromhex(k.decode()[len(remote.prefix):]), "big")
                  for k in client.keys(remote.prefix + "*") if b":owner:" not in k}
    assert stored == ({0, 1, 2} if mode == "back" else {2})
    assert chain.remote_wants(key(7)) is (mode == "selective") and not chain.remote_wants(key(2))
