"""GetPipe and SetPipe: pipelined Redis GETs whose values are received straight into buffers of
their own, and SETs whose values are sent straight from the caller's buffers.

The remote tier's hot path is one pipeline of GETs of ~0.7 MB values. redis-py's asyncio client
reads replies through a ``StreamReader``: each chunk is received into a new ``bytes``, appended
to the reader's buffer, and every value is sliced out of that buffer again — three copies of
every byte before the tier sees it, all on the I/O thread. `GetPipe` reads its replies with
resp_protocol.py's `ReplyReader` over an ``asyncio.BufferedProtocol`` instead: each byte is
copied once, by the kernel. Writes had the same cost the other way: the codec joined header and
payload, and redis-py joined the pipeline's pieces, CPU taken from the step loop's cores.
`SetPipe` sends each record's header and payload with ``sendmsg`` from where they lie. Both
speak only ``AUTH``, ``SELECT``, ``GET`` and ``SET``; everything else (existence checks, quotas,
Redis Cluster, TLS) stays with redis-py.

One pipeline at a time per connection (a lock); a reply stream that breaks, or a caller that
gives up (timeout, cancellation), closes the connection: the next call opens a fresh one.
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from cache.tiers.iov import advance
from cache.tiers.resp_protocol import ReplyReader, RespError, command

__all__ = ["WINDOWS_IN_FLIGHT", "WINDOW_BYTES", "GetPipe", "ReplyReader", "RespError", "SetPipe", "command",
           "endpoint", "setup_commands"]

# GETs go out in windows of about this many bytes of values, this many windows in flight. Redis
# runs every command of a pipeline it has read before writing any reply, so one long pipeline
# has it copy every value into fresh reply buffers before sending any; small windows keep its
# reply buffers small and reused and overlap its copying with our receiving (docs/tiers.md,
# "Figures behind the code").
WINDOW_BYTES = 4 << 20
WINDOWS_IN_FLIGHT = 3


def endpoint(url: str) -> dict[str, Any] | None:
    """Where and how to connect ({host, port} or {path}, plus username, password, db), read by
    redis-py's own URL parser, so loads authenticate and select exactly as the tier's writes do;
    None for a URL this module does not handle (``rediss://``: TLS stays with redis-py)."""
    from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url

    options = parse_url(url)
    kind = options.get("connection_class")
    if kind is SSLConnection:
        return None
    out: dict[str, Any] = {"username": options.get("username"), "password": options.get("password"),
                           "db": int(options.get("db") or 0)}
    if kind is UnixDomainSocketConnection:
        out["path"] = options["path"]
    else:
        out.update(host=options.get("host") or "localhost", port=int(options.get("port") or 6379))
    return out


def setup_commands(where: dict[str, Any]) -> list[bytes]:
    """AUTH and SELECT as the URL asks, to send first on a fresh connection."""
    setup = []
    if where["password"] is not None:
        user = [where["username"].encode()] if where["username"] else []
        setup.append(command(b"AUTH", *user, where["password"].encode()))
    if where["db"]:
        setup.append(command(b"SELECT", str(where["db"]).encode()))
    return setup


class GetPipe:
    """One connection to one Redis server for pipelined GETs (see the module docstring)."""

    def __init__(self, where: dict[str, Any], connect_timeout_s: float, max_value: int | None = None) -> None:
        self.where = where
        self.max_value = max_value
        self.connect_timeout_s = connect_timeout_s
        self._reader: ReplyReader | None = None
        self._lock = asyncio.Lock()

    async def get(self, keys: Sequence[str], dests: Sequence[memoryview | None] = (), head: int = 0,
                  on_value: Callable[[int, memoryview | tuple[memoryview, memoryview] | None], Any] | None = None,
                  ) -> list[Any]:
        """Values of ``keys`` (None: no such key, or not a string); raises on a broken or
        refused connection, leaving the pipe to reconnect on the next call. The value of
        ``keys[i]`` that is ``head`` + ``dests[i].nbytes`` bytes long is received as the pair
        (its first ``head`` bytes, ``dests[i]`` holding the rest); other values in buffers of
        their own. ``on_value(i, value)``, where given, runs as each value arrives and the list
        holds what it returns (it must not raise)."""
        if not keys:
            return []
        per = max(1, WINDOW_BYTES // self.max_value) if self.max_value else 16
        windows = [b"".join(command(b"GET", k.encode()) for k in keys[i:i + per]) for i in range(0, len(keys), per)]
        # window w + WINDOWS_IN_FLIGHT goes out once window w's replies are all in
        then = [(min(len(keys), (w + 1) * per), windows[w + WINDOWS_IN_FLIGHT])
                for w in range(len(windows) - WINDOWS_IN_FLIGHT)]

        def settle(i: int, reply: Any) -> Any:  # nil, status, integer or error replies: None
            value = reply if isinstance(reply, (memoryview, tuple)) else None
            return value if on_value is None else on_value(i, value)

        async with self._lock:
            try:
                reader = await self._connected()
                waiter = reader.expect(len(keys), then, dests, head, settle)
                assert isinstance(reader.transport, asyncio.WriteTransport)
                reader.transport.write(b"".join(windows[:WINDOWS_IN_FLIGHT]))
                replies = await waiter
            except BaseException:  # a timeout or cancellation leaves replies in flight: start over
                self.close()
                raise
        return replies

    async def _connected(self) -> ReplyReader:
        if self._reader is not None and self._reader.lost is None:
            return self._reader
        self.close()
        loop = asyncio.get_running_loop()
        where = self.where
        if "path" in where:
            opening = loop.create_unix_connection(lambda: ReplyReader(self.max_value), where["path"])
        else:
            opening = loop.create_connection(lambda: ReplyReader(self.max_value), where["host"], where["port"])
        _, reader = await asyncio.wait_for(opening, self.connect_timeout_s)
        self._reader = reader
        setup = setup_commands(where)
        if setup:
            waiter = reader.expect(len(setup))
            assert isinstance(reader.transport, asyncio.WriteTransport)
            reader.transport.write(b"".join(setup))
            for reply in await waiter:
                if isinstance(reply, RespError):
                    raise reply
        return reader

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None and reader.transport is not None:
            reader.transport.close()


_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)


def _send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Send every byte of ``buffers`` in order on the non-blocking ``sock`` (``sendmsg`` from
    where they lie), waiting in ``select`` while it is full; gives up when the socket is closed
    under it. Blocks: run it on a worker thread (`SetPipe.set` does)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        if sock.fileno() < 0:
            raise ConnectionError("the connection was closed while sending")
        try:
            sent = sock.sendmsg(views[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            select.select([], [sock], [], 0.1)
            continue
        views = advance(views, sent)


class SetPipe:
    """One connection to one Redis server for pipelined ``SET key value EX ttl`` whose values are
    sent from the caller's buffers, several per value (a header and a payload), with ``sendmsg``.

    A plain non-blocking socket: a worker thread sends (`_send_all`), replies are read by a
    `ReplyReader` fed from the loop's reader callback. One pipeline at a time (a lock); a broken
    stream, a timeout or a cancellation closes the connection: the next call reconnects.
    """

    def __init__(self, where: dict[str, Any], connect_timeout_s: float) -> None:
        self.where = where
        self.connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._reader: ReplyReader | None = None
        self._lock = asyncio.Lock()

    async def set(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]], ttl_s: int,
                  executor: Executor | None = None) -> list[Any]:
        """Store each ``(key, parts)``: the value is the parts one after the other. Returns one
        reply per item ("OK", or a `RespError` such as an OOM refusal); raises on a broken or
        refused connection. The bytes are sent by a thread of ``executor`` (None: the loop's
        default executor); the replies are read on the loop."""
        if not items:
            return []
        expiry = str(int(ttl_s)).encode()
        tail = b"\r\n$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(expiry), expiry)
        buffers: list[bytes | memoryview] = []
        for key, parts in items:
            name = key.encode()
            size = sum(memoryview(part).nbytes for part in parts)
            buffers.append(b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, size))
            buffers.extend(parts)
            buffers.append(tail)
        async with self._lock:
            try:
                sock, reader = await self._connected()
                waiter = reader.expect(len(items))
                await asyncio.get_running_loop().run_in_executor(executor, _send_all, sock, buffers)
                return await waiter
            except BaseException:
                self.close()
                raise

    def _readable(self) -> None:
        sock, reader = self._sock, self._reader
        if sock is None or reader is None:
            return
        try:
            n = sock.recv_into(reader.get_buffer(-1))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            reader.connection_lost(exc)
            self.close()
            return
        if n == 0:
            reader.connection_lost(None)
            self.close()
        else:
            reader.buffer_updated(n)

    async def _connected(self) -> tuple[socket.socket, ReplyReader]:
        if self._sock is not None and self._reader is not None and self._reader.lost is None:
            return self._sock, self._reader
        self.close()
        loop = asyncio.get_running_loop()
        where = self.where
        if "path" in where:
            sock, address = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), where["path"]
        else:
            infos = await loop.getaddrinfo(where["host"], where["port"], type=socket.SOCK_STREAM)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, address), self.connect_timeout_s)
        except BaseException:
            sock.close()
            raise
        reader = ReplyReader()
        self._sock, self._reader = sock, reader
        loop.add_reader(sock.fileno(), self._readable)
        setup = setup_commands(where)
        if setup:
            waiter = reader.expect(len(setup))
            _send_all(sock, setup)  # a few bytes on a fresh connection: they fit its buffer at once
            for reply in await waiter:
                if isinstance(reply, RespError):
                    raise reply
        return sock, reader

    def close(self) -> None:
        sock, self._sock = self._sock, None
        reader, self._reader = self._reader, None
        if sock is not None:
            try:
                asyncio.get_running_loop().remove_reader(sock.fileno())
            except RuntimeError:  # no loop running (closing at shutdown): nothing is registered then
                pass
            sock.close()
        if reader is not None and reader.lost is None:
            reader.connection_lost(ConnectionError("the connection was closed"))
