"""The RESP2 wire format, as much of it as `GetPipe` and `SetPipe` (resp.py) need: commands
encoded (`command`), and replies parsed by `ReplyReader` however the socket splits them.

The reader is an ``asyncio.BufferedProtocol``: the socket is read with ``recv_into``, and a bulk
string large enough is received straight into a buffer of its own (or the caller's), so each byte
of a value is copied once, by the kernel. Only strings, status and error replies, integers and
nils are read: that is all ``AUTH``, ``SELECT``, ``GET`` and ``SET`` answer.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any

import numpy

_SCRATCH_BYTES = 64 * 1024  # reply lines and the first bytes of values land here
_MAX_LINE = 64 * 1024
_DIRECT_MIN = 4096  # a value with at least this much still to come is received in place


class RespError(Exception):
    """The server answered with an error reply (``-ERR ...``), or broke the protocol."""


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

