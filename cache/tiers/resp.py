"""GetPipe and SetPipe: pipelined Redis GETs whose values are received straight into buffers of
their own, and SETs whose values are sent straight from the caller's buffers.

The remote tier's hot path is one pipeline of GETs of ~0.7 MB values. redis-py's asyncio client
reads replies through a ``StreamReader``: each chunk is received into a new ``bytes``, appended
to the reader's buffer, and every value is sliced out of that buffer again — three copies of
every byte before the tier sees it, all on the I/O thread (docs/tiers.md has the profile). This
module speaks just enough RESP2 for the two paths (``AUTH``, ``SELECT``, ``GET``, ``SET``): GETs over an
``asyncio.BufferedProtocol``: the socket is read with ``recv_into`` into the value's own buffer,
so each byte is copied once, by the kernel. Writes had the same cost the other way: the codec
joined header and payload (two copies) and redis-py joined the pipeline's pieces (a third), CPU
taken from the step loop's cores.
`SetPipe` sends each record's header and payload with ``sendmsg`` from where they lie. Everything
else (existence checks, quotas, Redis Cluster, TLS) stays with redis-py.

One pipeline at a time per connection (a lock); a reply stream that breaks, or a caller that
gives up (timeout, cancellation), closes the connection: the next call opens a fresh one.
"""

from __future__ import annotations

import asyncio
import collections
import select
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy

from cache.tiers.iov import advance

_SCRATCH_BYTES = 64 * 1024  # reply lines and the first bytes of values land here
_MAX_LINE = 64 * 1024
_DIRECT_MIN = 4096  # a value with at least this much still to come is received in place
# GETs go out in windows of about this many bytes of values, this many windows in flight. Redis
# runs every command of a pipeline it has read before writing any reply, so one long pipeline
# has it copy every value into fresh reply buffers before sending any; small windows keep its
# reply buffers small and reused and overlap its copying with our receiving (docs/tiers.md,
# "Figures behind the code").
WINDOW_BYTES = 4 << 20
WINDOWS_IN_FLIGHT = 3


class RespError(Exception):
    """The server answered with an error reply (``-ERR ...``), or broke the protocol."""


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


def command(*args: bytes) -> bytes:
    """One RESP command: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class ReplyReader(asyncio.BufferedProtocol):
    """Parses a stream of RESP2 replies; bulk strings go into numpy buffers of their size.

    `expect(n)` returns a future of the next ``n`` replies: a bulk string is a writable
    ``memoryview`` (None for a nil), a status reply a ``str``, an integer an ``int``, an error
    reply a `RespError` (in the list, not raised: one bad key does not fail the pipeline). A bulk
    string longer than ``max_value`` is read past without being kept and given as an empty
    buffer: a server (or a stranger's value under our key) cannot make us allocate what it says.
    A reply given a destination (`expect`'s ``dests``) whose size is ``head`` + the
    destination's is received in two parts: its first ``head`` bytes into a buffer of their own,
    the rest straight into the destination; the reply is then the pair (head, destination).
    """

    def __init__(self, max_value: int | None = None) -> None:
        self.max_value = max_value  # a longer value is read past, not kept: an empty buffer stands for it
        self._discard = 0  # bytes of such a value still to read past
        self.transport: asyncio.BaseTransport | None = None
        self._raw = bytearray(_SCRATCH_BYTES)
        self._scratch = memoryview(self._raw)
        self._direct = False  # the last get_buffer handed out the value itself
        self._line = bytearray()
        self._value: memoryview | None = None  # the bulk string (or the part of it) being received
        self._filled = 0
        self._rest: memoryview | None = None  # a scattered value's second part, after `_value`
        self._head_part: memoryview | None = None  # a scattered value's first part, once received
        self._dests: Sequence[memoryview | None] = ()
        self._head = 0
        self._on_reply: Callable[[int, Any], Any] | None = None
        self._skip = 0  # bytes of a value's trailing CRLF still to discard
        self._wanted = 0
        self._replies: list[Any] = []
        self._then: collections.deque[tuple[int, bytes]] = collections.deque()
        self._waiter: asyncio.Future[list[Any]] | None = None
        self.lost: BaseException | None = None

    # ---- asyncio callbacks --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("the Redis server closed the connection")
        self._settle(self.lost)

    def get_buffer(self, sizehint: int) -> memoryview:
        self._direct = self._value is not None and self._value.nbytes - self._filled >= _DIRECT_MIN
        if self._direct:
            assert self._value is not None
            return self._value[self._filled:]  # the kernel writes straight into the value
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._direct:
                assert self._value is not None
                self._filled += nbytes
                if self._filled == self._value.nbytes:
                    self._finish_value()
            else:
                self._feed(nbytes)
        except (RespError, ValueError) as exc:  # the stream is unusable from here on
            self.lost = exc if isinstance(exc, RespError) else RespError(f"malformed reply: {exc}")
            self._settle(self.lost)
            if self.transport is not None:
                self.transport.close()

    # ---- replies ------------------------------------------------------------------------------
    def expect(self, n: int, then: Sequence[tuple[int, bytes]] = (), dests: Sequence[memoryview | None] = (),
               head: int = 0, on_reply: Callable[[int, Any], Any] | None = None) -> asyncio.Future[list[Any]]:
        """A future of the next ``n`` replies; each ``(count, commands)`` of ``then`` is written
        once ``count`` of them have arrived (the later windows of a pipeline); reply ``i`` of
        ``head`` + ``dests[i].nbytes`` bytes is scattered into a head and ``dests[i]``;
        ``on_reply(i, reply)``, where given, runs as each reply completes (while the socket keeps
        filling) and its result takes the reply's place. It must not raise."""
        assert self._waiter is None, "one pipeline at a time"
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        self._wanted, self._replies = n, []
        self._then = collections.deque(then)
        self._dests, self._head, self._on_reply = dests, head, on_reply
        if self.lost is not None:
            self._settle(self.lost)
        return waiter

    def _feed(self, n: int) -> None:
        """Parse the first ``n`` bytes of the scratch buffer."""
        raw, i = self._raw, 0
        while i < n:
            if self._skip:
                step = min(self._skip, n - i)
                self._skip -= step
                i += step
            elif self._discard:
                step = min(self._discard, n - i)
                self._discard -= step
                i += step
                if not self._discard:
                    self._skip = 2
                    self._reply(memoryview(bytearray()))
            elif self._value is not None:
                step = min(self._value.nbytes - self._filled, n - i)
                self._value[self._filled:self._filled + step] = self._scratch[i:i + step]
                self._filled += step
                i += step
                if self._filled == self._value.nbytes:
                    self._finish_value()
            else:
                cut = raw.find(b"\n", i, n)
                if cut < 0:  # a line split across reads
                    self._line += raw[i:n]
                    if len(self._line) > _MAX_LINE:
                        raise RespError("reply line too long: not a Redis server")
                    return
                self._line += raw[i:cut + 1]
                i = cut + 1
                line, self._line = bytes(self._line), bytearray()
                self._line_done(line)

    def _line_done(self, line: bytes) -> None:
        if not line.endswith(b"\r\n") or len(line) < 3:
            raise RespError(f"malformed reply line {line[:40]!r}")
        kind, body = line[:1], line[1:-2]
        if kind == b"$":
            size = int(body)
            if size < 0:
                self._reply(None)
            elif self.max_value is not None and size > self.max_value:
                self._discard = size
            else:
                i = len(self._replies)
                dest = self._dests[i] if i < len(self._dests) else None
                if dest is not None and size == self._head + dest.nbytes:
                    self._value, self._rest = numpy.empty(self._head, dtype=numpy.uint8).data, dest
                else:
                    self._value = numpy.empty(size, dtype=numpy.uint8).data
                self._filled = 0
                if self._value.nbytes == 0:
                    self._finish_value()
        elif kind == b"+":
            self._reply(body.decode(errors="replace"))
        elif kind == b"-":
            self._reply(RespError(body.decode(errors="replace")))
        elif kind == b":":
            self._reply(int(body))
        else:
            raise RespError(f"unexpected reply type {kind!r} (only strings, errors and integers are read)")

    def _finish_value(self) -> None:
        value, self._value = self._value, None
        if self._rest is not None:  # a scattered value's head is in: the rest goes to its destination
            self._head_part, self._value, self._rest, self._filled = value, self._rest, None, 0
            if self._value.nbytes:
                return
            value, self._value = self._value, None
        reply: Any = value
        if self._head_part is not None:
            reply, self._head_part = (self._head_part, value), None
        self._skip = 2
        self._reply(reply)

    def _reply(self, value: Any) -> None:
        if self._waiter is None:
            raise RespError("a reply arrived that nothing asked for")
        self._replies.append(value if self._on_reply is None else self._on_reply(len(self._replies), value))
        while self._then and len(self._replies) >= self._then[0][0]:
            assert isinstance(self.transport, asyncio.WriteTransport)
            self.transport.write(self._then.popleft()[1])
        if len(self._replies) == self._wanted:
            self._settle(None)

    def _settle(self, exc: BaseException | None) -> None:
        waiter, self._waiter = self._waiter, None
        self._then.clear()
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(self._replies)
            else:
                waiter.set_exception(exc)


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
