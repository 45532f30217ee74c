"""Sealed records in the shared store (cache/tiers/store_mac.py): a record is loaded only if its
Poly1305 tag verifies under the deployment's store key for the very name it is read under.
Anything else — another secret's record, a flipped bit anywhere (nonce and tag included), a
record copied under another block's key, a truncated one — is a miss, counted as `unauthentic`,
deleted and logged once per batch; on both receive paths (in place into a slot, and redis-py's,
which TLS and Redis Cluster use). The key itself is never shown."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy
import pytest

from cache.tiers import factory
from cache.tiers.codec import HEADER_SIZE, BlockFormat, CorruptBlockError, encode
from cache.tiers.remote import RemoteTier
from cache.tiers.store_mac import MAC_NAME, NONCE_SIZE, SEAL_SIZE, StoreMac, UnauthenticBlockError

FMT = BlockFormat(bytes(range(32)), "float32", (2, 1024))  # 8 KiB blocks: received straight into slots
KEY = bytes(range(100, 132))
OTHER_KEY = bytes(range(200, 232))  # another deployment's secret
PATHS = ("in place", "redis-py")


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def payload(i: int) -> bytes:
    return numpy.random.default_rng(i).integers(0, 256, FMT.payload_size, dtype=numpy.uint8).tobytes()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def tier_on(url: str, path: str, mac_key: bytes = KEY) -> RemoteTier:
    """A remote tier reading through ``path``: "redis-py" is the path a rediss:// URL or a Redis
    Cluster takes (no in-place receiver, no direct sender)."""
    tier = RemoteTier(url, FMT, ttl_s=120, timeout_s=5.0, mac_key=mac_key)
    if path == "redis-py":
        tier._gets = tier._sets = None
    return tier


def slots(n: int) -> list[memoryview]:
    return [memoryview(bytearray(FMT.payload_size)) for _ in range(n)]


def filled(got: memoryview | None, slot: memoryview) -> bool:
    """Whether ``got`` is ``slot`` itself (a view of the same buffer), handed back as loaded."""
    return got is not None and got.obj is slot.obj


async def put_then_get(writer: RemoteTier, reader: RemoteTier, items: list[tuple[bytes, bytes]],
                       wanted: list[bytes], dests: list[memoryview]) -> list[memoryview | None]:
    try:
        assert await writer.put(items) == len(items)
        return await reader.get(wanted, dests)
    finally:
        await writer.close()
        if reader is not writer:
            await reader.close()


# ---- the seal alone -------------------------------------------------------------------------------


def test_a_seal_verifies_for_its_record_and_name_only() -> None:
    mac = StoreMac(KEY, FMT.fingerprint)
    record = encode(FMT, key(1), payload(1))
    seal = mac.seal(key(1), record[:HEADER_SIZE], record[HEADER_SIZE:])
    assert len(seal) == SEAL_SIZE
    mac.check(key(1), seal, record)  # in one piece or in two: the same bytes
    mac.check(key(1), seal, memoryview(record)[:7], memoryview(record)[7:])
    assert mac.open(key(1), seal + record).tobytes() == record
    for wrong in (lambda: mac.check(key(2), seal, record),  # copied under another block's key
                  lambda: StoreMac(KEY, bytes(32)).check(key(1), seal, record),  # under another model's
                  lambda: StoreMac(OTHER_KEY, FMT.fingerprint).check(key(1), seal, record),  # another secret
                  lambda: mac.open(key(1), seal[:SEAL_SIZE - 1]),  # too short to hold a seal
                  lambda: mac.check(key(1), seal, record[:-1])):
        with pytest.raises(UnauthenticBlockError):
            wrong()
    assert issubclass(UnauthenticBlockError, CorruptBlockError)  # a miss wherever a corrupt record is one


def test_every_seal_draws_a_fresh_nonce() -> None:
    """Poly1305 keys are one-time: two seals of the same record never share a nonce, so never a key."""
    mac = StoreMac(KEY, FMT.fingerprint)
    record = encode(FMT, key(1), payload(1))
    seals = {mac.seal(key(1), record) for _ in range(64)}
    assert len({s[:NONCE_SIZE] for s in seals}) == 64


@pytest.mark.parametrize("where", [0, NONCE_SIZE - 1, NONCE_SIZE, SEAL_SIZE - 1, SEAL_SIZE, SEAL_SIZE + 6,
                                   SEAL_SIZE + 86, SEAL_SIZE + HEADER_SIZE - 1, SEAL_SIZE + HEADER_SIZE,
                                   SEAL_SIZE + HEADER_SIZE + 4097, -1])
def test_one_flipped_bit_anywhere_fails_the_seal(where: int) -> None:
    """Nonce, tag, magic, dtype, block hash, codec, payload start, middle and end."""
    mac = StoreMac(KEY, FMT.fingerprint)
    record = encode(FMT, key(1), payload(1))
    value = bytearray(mac.seal(key(1), record) + record)
    value[where] ^= 0x10
    with pytest.raises(UnauthenticBlockError):
        mac.open(key(1), bytes(value))


def test_the_key_is_never_shown() -> None:
    mac = StoreMac(KEY, FMT.fingerprint)
    assert repr(mac) == f"StoreMac({MAC_NAME})" and KEY.hex() not in repr(mac)
    with pytest.raises(ValueError, match="mac_key") as short:
        StoreMac(KEY[:31], FMT.fingerprint)
    assert KEY[:31].hex() not in str(short.value) and repr(KEY[:31]) not in str(short.value)
    options = factory.validate("remote", {"url": "redis://x:6379/0", "mac_key": KEY})
    assert KEY.hex() not in repr(options) and str(KEY) not in repr(options) and "mac_key" not in options.model_dump()
    tier = factory.build("remote", options, factory.BuildContext(FMT, FMT.payload_size))
    assert isinstance(tier, RemoteTier)
    assert tier.describe()["mac"] == "poly1305" and KEY.hex() not in str(tier.describe())
    assert str(KEY) not in str(tier.describe()) and KEY.hex() not in repr(tier.__dict__)


def test_no_key_no_tier_and_a_request_cannot_set_one() -> None:
    with pytest.raises(TypeError, match="mac_key"):
        RemoteTier("redis://127.0.0.1:1/0", FMT)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="mac_key"):
        RemoteTier("redis://127.0.0.1:1/0", FMT, mac_key=None)  # type: ignore[arg-type]
    options = factory.validate("remote", {"url": "redis://x:6379/0"})
    with pytest.raises(ValueError, match="store's MAC key"):
        factory.build("remote", options, factory.BuildContext(FMT, FMT.payload_size))
    with pytest.raises(ValueError, match="unknown option.*mac_key") as refused:  # POST /admin/tiers' overrides
        factory.validate("remote", {"url": "redis://x:6379/0", "mac_key": KEY}, {"mac_key": OTHER_KEY.hex()})
    assert OTHER_KEY.hex() not in str(refused.value) and KEY.hex() not in str(refused.value)


# ---- the tier, on a real redis-server -----------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_round_trip_under_the_shared_key(redis_url: str, redis_server: Any, path: str) -> None:
    """Two replicas holding the same key: what one writes, the other loads, straight into its slots."""
    writer, reader = tier_on(redis_url, path), tier_on(redis_url, path)
    dests = slots(3)
    items = [(key(i), payload(i)) for i in range(3)]
    got = run(put_then_get(writer, reader, items, [key(0), key(1), key(2), key(9)], [*dests, *slots(1)]))
    assert [None if g is None else g.tobytes() for g in got] == [payload(0), payload(1), payload(2), None]
    assert all(filled(g, d) for g, d in zip(got[:3], dests, strict=True))  # the slots themselves, filled
    assert reader.stats.hits == 3 and reader.stats.unauthentic == 0 and reader.stats.corrupt == 0
    assert writer.stats.bytes_written == 3 * (SEAL_SIZE + FMT.record_size)
    with redis_server.client() as client:
        value = client.get(reader.key(key(0)))
        assert len(value) == SEAL_SIZE + FMT.record_size and value[SEAL_SIZE:] == encode(FMT, key(0), payload(0))


@pytest.mark.parametrize("path", PATHS)
def test_a_record_written_with_another_secret_is_never_loaded(redis_url: str, redis_server: Any, path: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    intruder, reader = tier_on(redis_url, path, OTHER_KEY), tier_on(redis_url, path)
    dests = slots(4)
    items = [(key(i), payload(i)) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="cache.tiers.remote"):
        got = run(put_then_get(intruder, reader, items, [k for k, _ in items], dests))
    assert got == [None] * 4
    assert reader.stats.unauthentic == 4 and reader.stats.misses == 4 and reader.stats.hits == 0
    assert reader.stats.corrupt == 0
    lines = [r.getMessage() for r in caplog.records if "failed authentication" in r.getMessage()]
    assert len(lines) == 1 and "4 of 4 records" in lines[0]  # once per batch, not once per block
    assert KEY.hex() not in caplog.text and OTHER_KEY.hex() not in caplog.text
    with redis_server.client() as client:
        assert client.exists(*(reader.key(k) for k, _ in items)) == 0  # deleted


def _tampered(redis_server: Any, tier: RemoteTier, change: Any) -> list[bytes]:
    """Store block 1 sealed as a replica would, and each value of ``change(that value)`` under a
    key of its own (blocks 100, 101, ...); those keys."""
    record = encode(FMT, key(1), payload(1))
    value = StoreMac(KEY, FMT.fingerprint).seal(key(1), record) + record
    names = []
    with redis_server.client() as client:
        client.set(tier.key(key(1)), value)
        for i, changed in enumerate(change(value)):
            client.set(tier.key(key(100 + i)), changed)
            names.append(key(100 + i))
    return names


@pytest.mark.parametrize("path", PATHS)
def test_flipped_bits_copies_and_truncations_are_rejected(redis_url: str, redis_server: Any, path: str) -> None:
    """Each altered value is stored under a key of its own; the reader asks for them all at once
    (with a slot each) along with the untouched original, which alone is loaded."""
    tier = tier_on(redis_url, path)
    positions = [0, 5, NONCE_SIZE, SEAL_SIZE - 1, SEAL_SIZE, SEAL_SIZE + 90, SEAL_SIZE + HEADER_SIZE - 1,
                 SEAL_SIZE + HEADER_SIZE, SEAL_SIZE + HEADER_SIZE + 5000, SEAL_SIZE + FMT.record_size - 1]
    cuts = [0, 10, SEAL_SIZE, SEAL_SIZE + HEADER_SIZE, SEAL_SIZE + FMT.record_size - 1]

    def change(value: bytes) -> list[bytes]:
        flips = []
        for where in positions:
            flipped = bytearray(value)
            flipped[where] ^= 0x01
            flips.append(bytes(flipped))
        # the untouched record under key 100 + len(...): a valid copy under another block's key
        return [*flips, value, *(value[:cut] for cut in cuts), value + b"\0"]

    wanted = _tampered(redis_server, tier, change)
    dests = slots(len(wanted) + 1)

    async def main() -> list[memoryview | None]:
        try:
            return await tier.get([*wanted, key(1)], dests)
        finally:
            await tier.close()

    got = run(main())
    assert got[:-1] == [None] * len(wanted) and filled(got[-1], dests[-1]) and dests[-1] == payload(1)
    assert tier.stats.unauthentic == len(wanted) and tier.stats.corrupt == 0 and tier.stats.hits == 1
    with redis_server.client() as client:
        assert client.exists(*(tier.key(k) for k in wanted)) == 0 and client.exists(tier.key(key(1))) == 1
        client.delete(tier.key(key(1)))
