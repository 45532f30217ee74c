"""RemoteTier on a real redis-server: batched round trips, key format, TTL, corrupt records, and a
store that is dead or frozen degrades to misses within the timeout, then recovers. (Sealed
records and what fails their MAC: tests/cache/test_store_mac.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from cache.tiers.codec import BlockFormat, encode
from cache.tiers.remote import RemoteTier
from cache.tiers.store_mac import SEAL_SIZE, StoreMac

MAC_KEY = bytes(range(100, 132))  # the store key every replica of a test deployment shares

FMT = BlockFormat(bytes(range(32)), "float32", (2, 4))
PAYLOAD = bytes(range(32))


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def run(coro):
    return asyncio.run(coro)


def sealed(block_hash: bytes, record: bytes, fmt: BlockFormat = FMT) -> bytes:
    """``record`` as a replica holding the store key writes it under ``block_hash``."""
    return StoreMac(MAC_KEY, fmt.fingerprint).seal(block_hash, record) + record


def test_put_exists_get_round_trip_with_the_documented_keys_and_a_ttl(redis_url, redis_server) -> None:
    async def main() -> None:
        tier = RemoteTier(redis_url, FMT, ttl_s=120, mac_key=MAC_KEY)
        try:
            assert await tier.put([(key(1), PAYLOAD), (key(2), PAYLOAD[::-1])]) == 2
            assert await tier.exists([key(1), key(3), key(2)]) == [True, False, True]
            assert await tier.get([key(1), key(2), key(3)]) == [PAYLOAD, PAYLOAD[::-1], None]
            assert tier.stats.hits == 2 and tier.stats.misses == 1 and tier.stats.puts == 2
        finally:
            await tier.close()

    run(main())
    with redis_server.client() as client:
        keys = sorted(k.decode() for k in client.keys("*"))
        assert keys == [f"kvgate:{FMT.fingerprint.hex()}:{key(i).hex()}" for i in (1, 2)]
        assert 0 < client.ttl(keys[0]) <= 120
        value = client.get(keys[0])
        assert value[SEAL_SIZE:] == encode(FMT, key(1), PAYLOAD)  # seal, header + bytes: no token ids, no text
        StoreMac(MAC_KEY, FMT.fingerprint).check(key(1), value[:SEAL_SIZE], value[SEAL_SIZE:])


def test_a_corrupt_or_foreign_record_is_a_miss_and_deleted(redis_url, redis_server) -> None:
    tier = RemoteTier(redis_url, FMT, mac_key=MAC_KEY)
    name = tier.key(key(5))
    other = BlockFormat(bytes(32), "float32", (2, 4))
    with redis_server.client() as client:
        client.set(name, sealed(key(5), encode(other, key(5), PAYLOAD)))  # another model's block, sealed
        client.set(tier.key(key(6)), b"garbage")
        client.set(tier.key(key(7)), b"x" * (FMT.record_size * 1000))  # too long: read past, never kept
        client.set(tier.key(key(8)), sealed(key(8), encode(FMT, key(8), PAYLOAD)))

    async def main() -> list:
        try:
            return await tier.get([key(5), key(6), key(7), key(8)])
        finally:
            await tier.close()

    assert run(main()) == [None, None, None, PAYLOAD]
    assert tier.stats.corrupt == 1 and tier.stats.unauthentic == 2  # garbage carries no valid seal
    with redis_server.client() as client:
        assert client.exists(name) == 0 and client.exists(tier.key(key(7))) == 0


def test_payloads_are_received_straight_into_the_given_destinations(redis_url, redis_server) -> None:
    """A destination per key (a host slot): the payload lands there and the result is that very
    buffer; a flipped payload byte or another model's record of the same size is still a miss."""
    tier = RemoteTier(redis_url, FMT, mac_key=MAC_KEY)
    flipped = bytearray(sealed(key(3), encode(FMT, key(3), PAYLOAD)))
    flipped[-1] ^= 1
    with redis_server.client() as client:
        client.set(tier.key(key(3)), bytes(flipped))
        client.set(tier.key(key(4)), sealed(key(4), encode(BlockFormat(bytes(32), "float32", (2, 4)), key(4), PAYLOAD)))
    dests = [bytearray(FMT.payload_size) for _ in range(5)]

    async def main() -> list:
        try:
            await tier.put([(key(1), PAYLOAD), (key(2), PAYLOAD[::-1])])
            return await tier.get([key(1), key(2), key(3), key(4), key(9)], [memoryview(d) for d in dests])
        finally:
            await tier.close()

    got = run(main())
    assert [g.obj if g is not None else None for g in got[:2]] == dests[:2] and got[2:] == [None, None, None]
    assert got[0].obj is dests[0] and got[1].obj is dests[1]
    assert dests[0] == PAYLOAD and dests[1] == PAYLOAD[::-1]
    assert tier.stats.hits == 2 and tier.stats.corrupt == 1 and tier.stats.unauthentic == 1 and tier.stats.misses == 3
    with redis_server.client() as client:
        assert client.exists(tier.key(key(3))) == 0 and client.exists(tier.key(key(4))) == 0
        client.delete(tier.key(key(1)), tier.key(key(2)))


def test_a_dead_store_is_a_fast_miss_and_opens_the_breaker(tmp_path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here

    async def main() -> None:
        tier = RemoteTier(f"redis://127.0.0.1:{port}/0", FMT, timeout_s=0.3, failures_to_open=2, open_s=60, mac_key=MAC_KEY)
        try:
            for _ in range(2):
                assert await tier.get([key(1)]) == [None]
            assert tier.breaker.state == "open" and tier.stats.errors == 2
            t0 = time.monotonic()
            assert await tier.exists([key(1), key(2)]) == [False, False]
            assert await tier.put([(key(1), PAYLOAD)]) == 0
            assert time.monotonic() - t0 < 0.2  # open breaker: no connection attempt at all
            assert tier.stats.errors == 2 and tier.stats.dropped == 1
            assert list(tier.unstored) == [key(1)]  # the chain will send it again once the store is back
        finally:
            await tier.close()

    run(main())


def test_a_frozen_store_times_out_then_service_recovers(redis_url, redis_server) -> None:
    async def main() -> None:
        tier = RemoteTier(redis_url, FMT, timeout_s=0.3, failures_to_open=1, open_s=0.2, mac_key=MAC_KEY)
        try:
            assert await tier.put([(key(1), PAYLOAD)]) == 1
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                assert await tier.get([key(1)]) == [None]
                assert time.monotonic() - t0 < 2.0  # bounded by the timeout, not hung
                assert tier.breaker.state == "open"
            finally:
                os.kill(redis_server.proc.pid, signal.SIGCONT)
            await asyncio.sleep(0.3)  # half-open: the next call probes
            for _ in range(20):
                if await tier.get([key(1)]) == [PAYLOAD]:
                    break
                await asyncio.sleep(0.1)
            assert tier.breaker.state == "closed"
            assert tier.stats.hits >= 1 and tier.breaker.trips >= 1
        finally:
            await tier.close()

    run(main())


@pytest.mark.parametrize("url", ["redis://user:secret@127.0.0.1:1/0"])
def test_the_password_never_reaches_the_log(url: str, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        tier = RemoteTier(url, FMT, timeout_s=0.2, mac_key=MAC_KEY)
        try:
            await tier.get([key(1)])
        finally:
            await tier.close()

    run(main())
    assert "secret" not in caplog.text and "***@127.0.0.1:1/0" in caplog.text


def test_a_large_write_goes_out_in_bounded_pipelines_and_lookups_run_between_them(
        redis_url, monkeypatch: pytest.MonkeyPatch) -> None:
    """One prompt's write-through in a single pipeline held every lookup behind its encoding and
    copies (~200 ms for 128 blocks of 720 KiB, through redis-py); now each pipeline carries at most
    WRITE_PIPELINE_BYTES and the I/O loop runs other work between them."""
    import cache.tiers.remote as remote_module

    fmt = BlockFormat(bytes(range(32)), "float32", (1024, 1024))  # 4 MiB records: a pipeline outlasts a lookup
    payload = bytes(fmt.payload_size)
    monkeypatch.setattr(remote_module, "WRITE_PIPELINE_BYTES", 3 * (SEAL_SIZE + fmt.record_size))
    pipelines: list[int] = []
    between: list[int] = []  # lookups that ran while the write was under way

    async def main() -> None:
        tier = RemoteTier(redis_url, fmt, timeout_s=10, mac_key=MAC_KEY)
        assert tier._sets is not None
        real_set = tier._sets.set

        async def counting_set(records, ttl_s, executor=None):  # type: ignore[no-untyped-def]
            pipelines.append(len(records))
            return await real_set(records, ttl_s, executor)

        tier._sets.set = counting_set  # type: ignore[method-assign]
        try:
            items = [(key(i), payload) for i in range(10)]
            writing = asyncio.ensure_future(tier.put(items))
            await asyncio.sleep(0)
            while not writing.done():
                assert await tier.exists([key(100)]) == [False]
                between.append(len(pipelines))
            assert writing.result() == 10
            assert await tier.get([k for k, _ in items]) == [payload] * 10
            assert tier.stats.writes == 4 and tier.stats.puts == 10
        finally:
            await tier.close()

    run(main())
    assert pipelines == [3, 3, 3, 1]
    assert any(0 < n < 4 for n in between)  # a lookup was answered between two of the write's pipelines


def test_records_are_written_without_redis_py_and_read_back_byte_for_byte(redis_url, redis_server) -> None:
    """Writes go through resp.SetPipe (header and payload sent from where they lie): the stored
    value is exactly the codec's record, with the TTL, for payloads given as bytes or as views."""
    fmt = BlockFormat(bytes(range(32)), "float32", (64, 1024))  # 256 KiB records: several sendmsg calls
    payloads = [os.urandom(fmt.payload_size) for _ in range(6)]

    async def main() -> None:
        tier = RemoteTier(redis_url, fmt, ttl_s=300, mac_key=MAC_KEY)
        assert tier._sets is not None
        try:
            items = [(key(i), p if i % 2 else memoryview(p)) for i, p in enumerate(payloads)]
            assert await tier.put(items) == len(items)
            assert [bytes(v) for v in await tier.get([key(i) for i in range(6)])] == payloads  # type: ignore[arg-type]
        finally:
            await tier.close()

    run(main())
    with redis_server.client() as client:
        names = [f"kvgate:{fmt.fingerprint.hex()}:{key(i).hex()}" for i in range(6)]
        try:
            values = [client.get(n) for n in names]
            assert [v[SEAL_SIZE:] for v in values] == [encode(fmt, key(i), p) for i, p in enumerate(payloads)]
            mac = StoreMac(MAC_KEY, fmt.fingerprint)
            for i, v in enumerate(values):
                mac.check(key(i), v[:SEAL_SIZE], v[SEAL_SIZE:])
            assert all(0 < client.ttl(n) <= 300 for n in names)
        finally:
            client.delete(*names)


def test_a_write_the_store_refuses_is_dropped_and_counted_not_raised(redis_url, redis_server) -> None:
    """Redis at maxmemory with noeviction answers SET with an -OOM error: the batch is dropped
    and counted, the blocks are marked unstored (sent again later), and nothing raises."""
    with redis_server.client() as client:
        client.config_set("maxmemory", "1")
        client.config_set("maxmemory-policy", "noeviction")
    try:
        async def main() -> RemoteTier:
            tier = RemoteTier(redis_url, FMT, mac_key=MAC_KEY)
            try:
                assert await tier.put([(key(40), PAYLOAD), (key(41), PAYLOAD)]) == 0
            finally:
                await tier.close()
            return tier

        tier = run(main())
        assert tier.stats.dropped == 2 and tier.stats.errors == 1 and tier.stats.puts == 0
        assert sorted(tier.unstored) == [key(40), key(41)]
    finally:
        with redis_server.client() as client:
            client.config_set("maxmemory", "0")
            client.delete(*(f"kvgate:{FMT.fingerprint.hex()}:{key(i).hex()}" for i in (40, 41)))


def test_a_large_load_goes_out_in_pipelines_each_under_the_timeout(redis_url, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole document's blocks in one GET pipeline shared one timeout: on a busy machine it ran
    out and the whole prefix was recomputed. Each pipeline now carries at most READ_PIPELINE_BYTES
    under its own timeout; one that fails ends the prefix there (the blocks after it continue
    nothing) and keeps what came before."""
    import cache.tiers.remote as remote_module

    monkeypatch.setattr(remote_module, "READ_PIPELINE_BYTES", 3 * (SEAL_SIZE + FMT.record_size))
    sizes: list[int] = []

    async def main() -> list:
        tier = RemoteTier(redis_url, FMT, mac_key=MAC_KEY)
        assert tier._gets is not None
        real_get = tier._gets.get

        async def counting_get(keys, dests, head, verify):  # type: ignore[no-untyped-def]
            sizes.append(len(keys))
            if len(sizes) == 3:  # the third pipeline fails, as a timeout would
                raise TimeoutError("frozen")
            return await real_get(keys, dests, head, verify)

        tier._gets.get = counting_get  # type: ignore[method-assign]
        try:
            items = [(key(i), bytes([i]) * len(PAYLOAD)) for i in range(10)]
            assert await tier.put(items) == 10
            got = await tier.get([k for k, _ in items])
            assert tier.stats.errors == 1 and tier.stats.hits == 6 and tier.stats.misses == 4
            await tier.delete([k for k, _ in items])
            return got
        finally:
            await tier.close()

    got = run(main())
    assert sizes == [3, 3, 3]
    assert got == [bytes([i]) * len(PAYLOAD) for i in range(6)] + [None] * 4
