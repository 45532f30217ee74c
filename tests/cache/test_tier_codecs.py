"""The disk and remote tiers with a codec: records written encoded, read back whatever the tier is
set to now, capacity and counters in encoded bytes, and a record with a damaged or unknown codec
a counted miss that never reaches a slot."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from cache.tiers.codec import HEADER_SIZE, BlockFormat, encode
from cache.tiers.disk import DiskTier
from cache.tiers.kv_codec import CODECS
from cache.tiers.remote import RemoteTier
from cache.tiers.store_mac import SEAL_SIZE, StoreMac

MAC_KEY = bytes(range(100, 132))  # the store key every replica of a test deployment shares

SHAPE = (2, 2, 4, 2, 8)  # layers, K|V, tokens, kv heads, head_dim: 1 KiB of float32
FMT = BlockFormat(bytes(range(32)), "float32", SHAPE)
OFF_CODEC = HEADER_SIZE - 2


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)) * (1 + i)


def payload(i: int) -> bytes:
    return block(i).numpy().tobytes()


def as_block(data: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(SHAPE)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def disk(path: Path, blocks: int, codec: str = "none", fmt: BlockFormat = FMT) -> DiskTier:
    return DiskTier(path, blocks * fmt.record_size_of(codec), fmt, codec=codec)


@pytest.mark.parametrize("codec", CODECS)
def test_disk_round_trip_per_codec_into_a_slot_and_without(tmp_path: Path, codec: str) -> None:
    tier = disk(tmp_path, 4, codec)
    assert run(tier.write(key(1), payload(1))) and run(tier.write(key(2), payload(1)))
    assert tier.path_of(key(1)).stat().st_size == FMT.record_size_of(codec)
    slot = numpy.zeros(FMT.payload_size, dtype=numpy.uint8)
    got, fresh = run(tier.read_many([key(1), key(2)], [slot.data, None]))
    assert got is not None and fresh is not None
    assert numpy.frombuffer(got, dtype=numpy.uint8).ctypes.data == slot.ctypes.data  # decoded into the slot
    x, bound = block(1), {"none": 0.0, "bf16": 2 ** -8, "fp16": 2 ** -11, "int8": 0.0}[codec]
    y = as_block(slot)
    assert torch.equal(as_block(fresh), y)
    if codec == "int8":
        assert ((y - x).abs() <= x.abs().amax(dim=(2, 4), keepdim=True) / 127).all()
    else:
        assert ((y - x).abs() <= bound * x.abs()).all()
    assert tier.describe()["codec"] == codec


def test_a_block_written_with_bf16_is_read_after_the_setting_changes(tmp_path: Path) -> None:
    first = disk(tmp_path, 4, "bf16")
    assert run(first.write(key(1), payload(1)))
    again = disk(tmp_path, 4, "none")  # restart with another codec: the folder is indexed again
    assert key(1) in again and again.nbytes == FMT.record_size_of("bf16")
    got = run(again.read(key(1)))
    assert got is not None and torch.equal(as_block(got), block(1).bfloat16().float())
    assert run(again.write(key(2), payload(2)))  # written with the tier's codec now
    assert again.path_of(key(2)).stat().st_size == FMT.record_size
    assert bytes(run(again.read(key(2))) or b"") == payload(2)
    again.check_invariants()


def test_capacity_and_counters_are_in_encoded_bytes(tmp_path: Path) -> None:
    capacity = 8 * FMT.record_size
    plain = DiskTier(tmp_path / "a", capacity, FMT)
    halved = DiskTier(tmp_path / "b", capacity, FMT, codec="bf16")
    assert halved.capacity_blocks == capacity // FMT.record_size_of("bf16") > 1.5 * plain.capacity_blocks
    for i in range(halved.capacity_blocks + 3):
        assert run(halved.write(key(i), payload(i)))
    size = FMT.record_size_of("bf16")
    assert len(halved) == halved.capacity_blocks and halved.nbytes == len(halved) * size <= capacity
    assert halved.stats.evictions == 3
    assert halved.stats.bytes_written == (halved.capacity_blocks + 3) * size
    run(halved.read(key(5)))
    assert halved.stats.bytes_read == size
    halved.check_invariants()


def test_a_mixed_folder_counts_each_record_at_its_size(tmp_path: Path) -> None:
    for i, codec in enumerate(CODECS):
        assert run(disk(tmp_path, 8, codec).write(key(i), payload(i)))
    tier = disk(tmp_path, 8, "int8")
    assert len(tier) == 4 and tier.nbytes == sum(FMT.record_size_of(c) for c in CODECS)
    # a smaller tier keeps what fits, in bytes, dropping the oldest
    small = DiskTier(tmp_path, FMT.record_size + FMT.record_size_of("int8"), FMT, codec="int8")
    assert 1 <= len(small) < 4 and small.nbytes <= small.capacity_bytes
    small.check_invariants()


@pytest.mark.parametrize("codec_id, counter", [(0x81, "undecodable"), (CODECS.index("int8"), "corrupt"),
                                               (CODECS.index("fp16"), "corrupt")])
def test_a_record_whose_codec_field_is_changed_is_a_counted_miss(tmp_path: Path, codec_id: int,
                                                                 counter: str) -> None:
    tier = disk(tmp_path, 4, "bf16")
    assert run(tier.write(key(1), payload(1)))
    path = tier.path_of(key(1))
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, OFF_CODEC, codec_id)
    path.write_bytes(bytes(data))
    slot = numpy.full(FMT.payload_size, 0xAB, dtype=numpy.uint8)
    assert run(tier.read_many([key(1)], [slot.data])) == [None]
    assert getattr(tier.stats, counter) == 1 and tier.stats.misses == 1 and tier.stats.hits == 0
    assert key(1) not in tier and not path.exists()
    other = "corrupt" if counter == "undecodable" else "undecodable"
    assert getattr(tier.stats, other) == 0


def test_a_flipped_payload_byte_of_an_encoded_record_is_caught(tmp_path: Path) -> None:
    tier = disk(tmp_path, 4, "int8")
    assert run(tier.write(key(1), payload(1)))
    path = tier.path_of(key(1))
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 40] ^= 0x04
    path.write_bytes(bytes(data))
    assert run(tier.read(key(1))) is None and tier.stats.corrupt == 1


def test_a_version_2_record_is_a_miss(tmp_path: Path) -> None:
    tier = disk(tmp_path, 4)
    assert run(tier.write(key(1), payload(1)))
    path = tier.path_of(key(1))
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 4, 2)
    path.write_bytes(bytes(data))
    assert run(tier.read(key(1))) is None and tier.stats.corrupt == 1


# ---- remote ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_remote_round_trip_with_a_codec(redis_url: str, redis_server: Any, codec: str) -> None:
    writer = RemoteTier(redis_url, FMT, ttl_s=120, codec=codec, mac_key=MAC_KEY)
    reader = RemoteTier(redis_url, FMT, ttl_s=120, mac_key=MAC_KEY)  # set to none: decodes what the record says
    slots = [numpy.zeros(FMT.payload_size, dtype=numpy.uint8).data for _ in range(2)]

    async def main() -> tuple[list[Any], list[Any]]:
        try:
            assert await writer.put([(key(1), payload(1)), (key(2), payload(2))]) == 2
            return await reader.get([key(1), key(2)], slots), await reader.get([key(1), key(3)])
        finally:
            await writer.close()
            await reader.close()

    into, fresh = run(main())
    assert writer.stats.bytes_written == 2 * (SEAL_SIZE + FMT.record_size_of(codec))
    assert into[0] is slots[0] and into[1] is slots[1]
    for i in (1, 2):
        x, y = block(i), as_block(slots[i - 1])
        bound = x.abs().amax(dim=(2, 4), keepdim=True) / 127 if codec == "int8" else 2 ** -8 * x.abs()
        assert ((y - x).abs() <= bound).all()
    assert fresh[1] is None and torch.equal(as_block(fresh[0]), as_block(slots[0]))
    assert reader.stats.bytes_read == 3 * (SEAL_SIZE + FMT.record_size_of(codec)) and reader.stats.hits == 3
    assert reader.describe()["codec"] == "none"
    with redis_server.client() as client:
        assert len(client.get(reader.key(key(1)))) == SEAL_SIZE + FMT.record_size_of(codec)


def test_remote_record_of_an_unknown_codec_is_a_counted_miss_and_deleted(redis_url: str, redis_server: Any) -> None:
    tier = RemoteTier(redis_url, FMT, codec="bf16", mac_key=MAC_KEY)
    data = bytearray(encode(FMT, key(4), payload(4), "bf16"))
    struct.pack_into("<H", data, OFF_CODEC, 0x7F)
    seal = StoreMac(MAC_KEY, FMT.fingerprint).seal(key(4), bytes(data))  # by a replica that knows the codec
    with redis_server.client() as client:
        client.set(tier.key(key(4)), seal + bytes(data))

    async def main() -> list[Any]:
        try:
            return await tier.get([key(4)], [numpy.zeros(FMT.payload_size, dtype=numpy.uint8).data])
        finally:
            await tier.close()

    assert run(main()) == [None]
    assert tier.stats.undecodable == 1 and tier.stats.corrupt == 0 and tier.stats.misses == 1
    with redis_server.client() as client:
        assert client.get(tier.key(key(4))) is None
