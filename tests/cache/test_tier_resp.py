"""GetPipe / ReplyReader: RESP2 replies parsed however the socket splits them, values received in
place, and pipelined GETs against a real redis-server (password, database, errors, reconnects)."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache.tiers import resp
from cache.tiers.resp import GetPipe, ReplyReader, RespError, SetPipe, command, endpoint

BIG = os.urandom(300_000)  # several socket reads, most of it received straight into its buffer
REPLIES = [b"$5\r\nhello\r\n", b"$-1\r\n", b"$%d\r\n%s\r\n" % (len(BIG), BIG), b"+OK\r\n",
           b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n", b":42\r\n",
           b"$0\r\n\r\n", b"$8\r\n\r\nab\r\ncd\r\n"]
STREAM = b"".join(REPLIES)


def expected() -> list[object]:
    return [b"hello", None, BIG, "OK", RespError("WRONGTYPE Operation against a key holding the wrong kind of value"),
            42, b"", b"\r\nab\r\ncd"]


def feed(reader: ReplyReader, data: bytes, cuts: list[int]) -> None:
    """Deliver ``data`` the way asyncio does: into whatever buffer the protocol hands out, never
    more than it holds, ending reads at ``cuts`` (and wherever a buffer is full)."""
    pos, stops = 0, sorted({c for c in cuts if 0 < c < len(data)} | {len(data)})
    for stop in stops:
        while pos < stop:
            buf = reader.get_buffer(-1)
            n = min(len(buf), stop - pos)
            buf[:n] = data[pos:pos + n]
            reader.buffer_updated(n)
            pos += n


def check(replies: list[object]) -> None:
    want = expected()
    assert len(replies) == len(want)
    for got, exp in zip(replies, want, strict=True):
        if isinstance(exp, RespError):
            assert isinstance(got, RespError) and str(got) == str(exp)
        elif isinstance(exp, bytes):
            assert isinstance(got, memoryview) and not got.readonly and bytes(got) == exp
        else:
            assert got == exp


def parse(cuts: list[int]) -> list[object]:
    async def main() -> list[object]:
        reader = ReplyReader()
        waiter = reader.expect(len(REPLIES))
        feed(reader, STREAM, cuts)
        return await waiter

    return asyncio.run(main())


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 4095, 4096, 65536, len(STREAM)])
def test_replies_parse_the_same_in_chunks_of_any_size(chunk: int) -> None:
    check(parse(list(range(chunk, len(STREAM), chunk))))


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=40))
def test_replies_parse_the_same_wherever_the_socket_splits_them(cuts: list[int]) -> None:
    check(parse(cuts))


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_a_value_over_the_limit_is_read_past_and_given_as_an_empty_buffer(chunk: int) -> None:
    async def main() -> list[object]:
        reader = ReplyReader(max_value=1000)
        waiter = reader.expect(3)
        data = b"$%d\r\n%s\r\n$3\r\nabc\r\n$1000\r\n%s\r\n" % (len(BIG), BIG, b"y" * 1000)
        feed(reader, data, list(range(chunk, len(data), chunk)))
        return await waiter

    first, second, third = asyncio.run(main())
    assert isinstance(first, memoryview) and first.nbytes == 0
    assert bytes(second) == b"abc" and bytes(third) == b"y" * 1000


def test_the_large_value_is_received_in_its_own_buffer_not_the_scratch() -> None:
    async def main() -> None:
        reader = ReplyReader()
        reader.expect(1)
        head = b"$%d\r\n" % len(BIG)
        feed(reader, head + BIG[:10], [])
        buf = reader.get_buffer(-1)  # the rest of the value: its own buffer, exactly what is left
        assert len(buf) == len(BIG) - 10

    asyncio.run(main())


HEAD = 16
SCATTER = [b"$%d\r\n%s\r\n" % (HEAD + len(BIG), b"h" * HEAD + BIG),  # head + destination: scattered
           b"$3\r\nabc\r\n",  # another size than its destination: a buffer of its own
           b"$-1\r\n",  # a nil: the destination stays untouched
           b"$%d\r\n%s\r\n" % (HEAD, b"k" * HEAD),  # an empty destination: the head alone
           b"$%d\r\n%s\r\n" % (HEAD + 5, b"g" * HEAD + b"tail!")]  # no destination for it
SCATTER_STREAM = b"".join(SCATTER)


def scatter(cuts: list[int]) -> tuple[list[object], list[bytearray]]:
    dests = [bytearray(len(BIG)), bytearray(10), bytearray(7), bytearray(0)]

    async def main() -> list[object]:
        reader = ReplyReader()
        waiter = reader.expect(len(SCATTER), dests=[memoryview(d) for d in dests], head=HEAD)
        feed(reader, SCATTER_STREAM, cuts)
        return await waiter

    return asyncio.run(main()), dests


@given(st.lists(st.integers(min_value=1, max_value=len(SCATTER_STREAM) - 1), max_size=30))
def test_a_value_of_head_plus_destination_size_is_scattered_into_them(cuts: list[int]) -> None:
    (first, second, third, fourth, fifth), dests = scatter(cuts)
    assert isinstance(first, tuple) and bytes(first[0]) == b"h" * HEAD and first[1].obj is dests[0]
    assert dests[0] == BIG
    assert isinstance(second, memoryview) and bytes(second) == b"abc" and dests[1] == bytearray(10)
    assert third is None and dests[2] == bytearray(7)
    assert isinstance(fourth, tuple) and bytes(fourth[0]) == b"k" * HEAD and fourth[1].nbytes == 0
    assert isinstance(fifth, memoryview) and bytes(fifth) == b"g" * HEAD + b"tail!"


def test_the_rest_of_a_scattered_value_is_received_straight_into_its_destination() -> None:
    async def main() -> None:
        dest = bytearray(len(BIG))
        reader = ReplyReader()
        reader.expect(1, dests=[memoryview(dest)], head=HEAD)
        feed(reader, b"$%d\r\n" % (HEAD + len(BIG)) + b"h" * HEAD + BIG[:10], [])
        buf = reader.get_buffer(-1)  # the kernel would write into the destination itself
        assert buf.obj is dest and len(buf) == len(BIG) - 10

    asyncio.run(main())


@pytest.mark.parametrize("garbage", [b"?what\r\n", b"$abc\r\n", b"*2\r\n$1\r\na\r\n$1\r\nb\r\n", b"x" * 70_000])
def test_a_broken_stream_fails_the_waiter_with_a_clear_error(garbage: bytes) -> None:
    async def main() -> None:
        reader = ReplyReader()
        waiter = reader.expect(1)
        feed(reader, garbage, [])
        with pytest.raises(RespError):
            await waiter

    asyncio.run(main())


class RecordingTransport(asyncio.WriteTransport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []

    def write(self, data) -> None:  # type: ignore[no-untyped-def]
        self.written.append(bytes(data))


def test_later_windows_are_written_as_the_replies_before_them_arrive() -> None:
    async def main() -> None:
        reader = ReplyReader()
        transport = RecordingTransport()
        reader.connection_made(transport)
        waiter = reader.expect(4, [(1, b"third"), (3, b"fourth")])
        assert transport.written == []
        feed(reader, b"+a\r\n", [])
        assert transport.written == [b"third"]
        feed(reader, b"+b\r\n", [])
        assert transport.written == [b"third"]
        feed(reader, b"+c\r\n+d\r\n", [])
        assert transport.written == [b"third", b"fourth"]
        assert await waiter == ["a", "b", "c", "d"]

    asyncio.run(main())


def test_a_reply_nobody_asked_for_marks_the_connection_unusable() -> None:
    async def main() -> None:
        reader = ReplyReader()
        waiter = reader.expect(1)
        feed(reader, b"+OK\r\n+EXTRA\r\n", [])
        assert await waiter == ["OK"]
        assert isinstance(reader.lost, RespError)  # GetPipe opens a fresh connection next time
        with pytest.raises(RespError):
            await reader.expect(1)

    asyncio.run(main())


def test_a_large_value_nobody_asked_for_marks_the_connection_unusable() -> None:
    async def main() -> None:
        reader = ReplyReader()
        waiter = reader.expect(1)
        feed(reader, b"+OK\r\n$%d\r\n%s\r\n" % (len(BIG), BIG), [])  # the value lands in place
        assert await waiter == ["OK"]
        assert isinstance(reader.lost, RespError)

    asyncio.run(main())


def test_endpoint_reads_redis_and_unix_urls_and_declines_tls() -> None:
    assert endpoint("redis://127.0.0.1:7000/2") == {"host": "127.0.0.1", "port": 7000, "db": 2,
                                                    "username": None, "password": None}
    # as redis-py reads it (the tier's writes connect with redis-py): a password given as a query option
    assert endpoint("redis://h?password=pw&db=4") == {"host": "h", "port": 6379, "db": 4,
                                                       "username": None, "password": "pw"}
    assert endpoint("redis://u%40x:p%3Aw@h") == {"host": "h", "port": 6379, "db": 0, "username": "u@x", "password": "p:w"}
    assert endpoint("unix:///run/redis.sock?db=3") == {"path": "/run/redis.sock", "db": 3,
                                                        "username": None, "password": None}
    assert endpoint("rediss://h:6380/0") is None


def test_command_is_a_resp_array_of_bulk_strings() -> None:
    assert command(b"GET", b"k") == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_pipelined_gets_against_a_real_server(redis_url, redis_server) -> None:
    with redis_server.client() as client:
        client.set("kvg-test:big", BIG)
        client.set("kvg-test:small", b"x")
        client.rpush("kvg-test:list", b"a")

    async def main() -> None:
        pipe = GetPipe(endpoint(redis_url), 2.0)
        try:
            got = await pipe.get(["kvg-test:big", "kvg-test:missing", "kvg-test:small", "kvg-test:list"])
            assert [bytes(v) if v is not None else None for v in got] == [BIG, None, b"x", None]
            for _ in range(3):  # the connection is reused
                assert bytes((await pipe.get(["kvg-test:small"]))[0]) == b"x"
            assert await pipe.get([]) == []
        finally:
            pipe.close()

    run(main())


def test_gets_in_many_windows_come_back_in_order(redis_url, redis_server, monkeypatch) -> None:
    values = [os.urandom(1000 + 37 * i) for i in range(40)]
    keys = [f"kvg-test:win:{i}" for i in range(40)]
    with redis_server.client() as client:
        client.mset(dict(zip(keys, values, strict=True)))
    monkeypatch.setattr(resp, "WINDOW_BYTES", 5000)  # 2 keys per window of 2.5 kB values, 20 windows

    async def main() -> None:
        pipe = GetPipe(endpoint(redis_url), 2.0, max_value=2500)
        try:
            got = await asyncio.wait_for(pipe.get([*keys[:17], "kvg-test:win:missing", *keys[17:]]), 10)
            assert [bytes(v) if v is not None else None for v in got] == [*values[:17], None, *values[17:]]
        finally:
            pipe.close()

    try:
        run(main())
    finally:
        with redis_server.client() as client:
            client.delete(*keys)


def _gets_of(redis_url, redis_server, stored: dict[str, bytes], keys: list[str], max_value: int, **kwargs):  # type: ignore[no-untyped-def]
    """Store ``stored``, GET ``keys`` through a fresh GetPipe (``kwargs`` for `GetPipe.get`), and
    delete ``stored`` again."""
    with redis_server.client() as client:
        client.mset(stored)

    async def main() -> list:
        pipe = GetPipe(endpoint(redis_url), 2.0, max_value=max_value)
        try:
            return await asyncio.wait_for(pipe.get(keys, **kwargs), 10)
        finally:
            pipe.close()

    try:
        return run(main())
    finally:
        with redis_server.client() as client:
            client.delete(*stored)


def test_gets_scatter_values_into_destinations_over_many_windows(redis_url, redis_server, monkeypatch) -> None:
    values = [os.urandom(HEAD + 1000) for _ in range(9)]
    keys = [f"kvg-test:scatter:{i}" for i in range(9)]
    monkeypatch.setattr(resp, "WINDOW_BYTES", 2000)  # 2 values per window
    dests = [bytearray(1000) for _ in range(11)]
    got = _gets_of(redis_url, redis_server, {**dict(zip(keys, values, strict=True)), "kvg-test:scatter:short": b"x" * 50},
                   [*keys, "kvg-test:scatter:missing", "kvg-test:scatter:short"], HEAD + 1000,
                   dests=[memoryview(d) for d in dests], head=HEAD)
    for value, reply, dest in zip(values, got[:9], dests, strict=False):
        assert isinstance(reply, tuple) and bytes(reply[0]) == value[:HEAD] and reply[1].obj is dest
        assert dest == value[HEAD:]
    assert got[9] is None and bytes(got[10]) == b"x" * 50 and dests[10] == bytearray(1000)


def test_each_value_is_handed_to_on_value_as_it_arrives(redis_url, redis_server, monkeypatch) -> None:
    """on_value(i, value) runs once per reply, in order, while later windows are still unsent;
    the list holds what it returned; a nil or a non-string is None."""
    keys = [f"kvg-test:each:{i}" for i in range(6)]
    values = [b"v%d" % i * 400 for i in range(6)]
    monkeypatch.setattr(resp, "WINDOW_BYTES", 1000)  # one value per window: 8 windows, 3 sent at first
    readers: list[ReplyReader] = []
    expect = ReplyReader.expect

    def recording_expect(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        readers.append(self)
        return expect(self, *args, **kwargs)

    monkeypatch.setattr(ReplyReader, "expect", recording_expect)
    seen: list[tuple[int, object, int]] = []

    def on_value(i: int, value):  # type: ignore[no-untyped-def]
        seen.append((i, None if value is None else bytes(value), len(readers[-1]._then)))
        return ("handled", i)

    with redis_server.client() as client:
        client.rpush("kvg-test:each:list", b"a")
    try:
        got = _gets_of(redis_url, redis_server, dict(zip(keys, values, strict=True)),
                       [*keys[:3], "kvg-test:each:list", "kvg-test:each:missing", *keys[3:]], 1000,
                       on_value=on_value)
    finally:
        with redis_server.client() as client:
            client.delete("kvg-test:each:list")
    assert got == [("handled", i) for i in range(8)]
    assert [(i, v) for i, v, _ in seen] == list(enumerate([*values[:3], None, None, *values[3:]]))
    assert seen[0][2] == 5  # the first value was handled before windows 4-8 went out


def test_a_password_and_a_database_from_the_url_are_used(redis_server) -> None:
    with redis_server.client() as client:
        client.execute_command("ACL", "SETUSER", "kvg-reader", "on", ">s3cret", "~*", "+@all")
        client.select(5)
        client.set("kvg-test:db5", b"five")
    try:
        async def main() -> None:
            good = GetPipe(endpoint(f"redis://kvg-reader:s3cret@127.0.0.1:{redis_server.port}/5"), 2.0)
            bad = GetPipe(endpoint(f"redis://kvg-reader:wrong@127.0.0.1:{redis_server.port}/5"), 2.0)
            writer = SetPipe(endpoint(f"redis://kvg-reader:s3cret@127.0.0.1:{redis_server.port}/5"), 2.0)
            bad_writer = SetPipe(endpoint(f"redis://kvg-reader:wrong@127.0.0.1:{redis_server.port}/5"), 2.0)
            try:
                assert bytes((await good.get(["kvg-test:db5"]))[0]) == b"five"
                with pytest.raises(RespError, match="WRONGPASS"):
                    await bad.get(["kvg-test:db5"])
                assert await writer.set([("kvg-test:db5w", [b"fi", b"ve"])], 60) == ["OK"]
                assert bytes((await good.get(["kvg-test:db5w"]))[0]) == b"five"
                with pytest.raises(RespError, match="WRONGPASS"):
                    await bad_writer.set([("kvg-test:db5w", [b"x"])], 60)
                assert bad_writer._sock is None
            finally:
                good.close()
                bad.close()
                writer.close()
                bad_writer.close()

        run(main())
    finally:
        with redis_server.client() as client:
            client.execute_command("ACL", "DELUSER", "kvg-reader")
            client.select(5)
            client.delete("kvg-test:db5", "kvg-test:db5w")


def test_sets_send_each_value_from_its_parts_with_the_ttl(redis_url, redis_server) -> None:
    big = os.urandom(3_000_000)  # more than a socket buffer: sendmsg sends it in pieces

    async def main() -> None:
        pipe = SetPipe(endpoint(redis_url), 2.0)
        try:
            items = [("kvg-test:s1", [b"head-", memoryview(big)]), ("kvg-test:s2", [b""]), ("kvg-test:s3", [b"a", b"b", b"c"])]
            assert await asyncio.wait_for(pipe.set(items, 77), 10) == ["OK", "OK", "OK"]
            assert await pipe.set([], 77) == []
        finally:
            pipe.close()

    try:
        run(main())
        with redis_server.client() as client:
            assert client.get("kvg-test:s1") == b"head-" + big
            assert client.get("kvg-test:s2") == b"" and client.get("kvg-test:s3") == b"abc"
            assert 0 < client.ttl("kvg-test:s1") <= 77
    finally:
        with redis_server.client() as client:
            client.delete("kvg-test:s1", "kvg-test:s2", "kvg-test:s3")


def test_sets_can_be_sent_from_a_worker_thread(redis_url, redis_server) -> None:
    """With an executor the payload is sent by its thread (waiting in select while the socket is
    full); the replies are still read on the loop."""
    from concurrent.futures import ThreadPoolExecutor

    big = [os.urandom(2_000_000) for _ in range(4)]

    async def main() -> None:
        pipe = SetPipe(endpoint(redis_url), 2.0)
        try:
            with ThreadPoolExecutor(1) as pool:
                items = [(f"kvg-test:t{i}", [b"h", memoryview(v)]) for i, v in enumerate(big)]
                assert await asyncio.wait_for(pipe.set(items, 60, executor=pool), 10) == ["OK"] * 4
        finally:
            pipe.close()

    try:
        run(main())
        with redis_server.client() as client:
            assert [client.get(f"kvg-test:t{i}") for i in range(4)] == [b"h" + v for v in big]
    finally:
        with redis_server.client() as client:
            client.delete(*(f"kvg-test:t{i}" for i in range(4)))


def test_a_connection_the_server_drops_is_reopened_on_the_next_call(redis_url, redis_server) -> None:
    with redis_server.client() as client:
        client.set("kvg-test:k", b"v")

    async def main() -> None:
        pipe = GetPipe(endpoint(redis_url), 2.0)
        writer = SetPipe(endpoint(redis_url), 2.0)
        try:
            assert bytes((await pipe.get(["kvg-test:k"]))[0]) == b"v"
            assert await writer.set([("kvg-test:k", [b"v"])], 60) == ["OK"]
            with redis_server.client() as client:
                client.client_kill_filter(_type="normal", skipme=True)
            await asyncio.sleep(0.1)
            try:
                await pipe.get(["kvg-test:k"])  # may still see the dead connection once
            except (ConnectionError, OSError):
                pass
            try:
                await writer.set([("kvg-test:k", [b"v"])], 60)
            except (ConnectionError, OSError):
                pass
            assert await writer.set([("kvg-test:k", [b"w"])], 60) == ["OK"]
            assert bytes((await pipe.get(["kvg-test:k"]))[0]) == b"w"
        finally:
            pipe.close()
            writer.close()

    run(main())


def test_a_refused_connection_raises_and_leaves_nothing_open() -> None:
    async def main() -> None:
        pipe = GetPipe(endpoint("redis://127.0.0.1:1/0"), 1.0)
        with pytest.raises(OSError):
            await pipe.get(["k"])
        assert pipe._reader is None
        writer = SetPipe(endpoint("redis://127.0.0.1:1/0"), 1.0)
        with pytest.raises(OSError):
            await writer.set([("k", [b"v"])], 60)
        assert writer._sock is None and writer._reader is None

    run(main())
