"""KV events on the wire: the engine's `cache.events.EventLog`, published on a ZMQ PUB socket in
the layout vLLM publishes, so a router (`kvgate route`, llm-d's scorer, Dynamo's KV router)
knows which replica holds which prefix.

    one message = 3 frames: topic | sequence (u64, big-endian) | msgpack payload
    payload     = [ts, [event, ...], data_parallel_rank]                (KVEventBatch, array-like)
    event       = ["BlockStored", [hash, ...], parent | None, [], block_size, None, medium]
                | ["BlockRemoved", [hash, ...], medium]
                | ["AllBlocksCleared"]

Hashes are the salted 32-byte block keys; token ids are never sent (the list is empty), nor
text nor a tenant's name: a router computes a tenant's keys itself, from the same salt. Mediums:
"GPU" (the engine's own pool, on whatever device), "CPU" (host tier), "DISK", "REMOTE". A start
publishes `AllBlocksCleared`, then the blocks a disk tier already holds.

A replay socket (ZMQ ROUTER, optional) answers a request ``[b"", start sequence (u64 BE)]`` with
every kept batch from that sequence on, each as ``[b"", sequence, payload]``, then
``[b"", -1 (i64 BE), b""]``, as vLLM's does: a subscriber that saw a gap asks for what it missed.

The publisher is one thread that owns both sockets (ZMQ sockets are not thread-safe); the step
loop and the tiers' I/O thread only append to the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from cache.events import (
    CLEARED,
    DEVICE_MEDIUM,
    NO_EVENTS,
    REMOVED,
    STORED,
    Event,
    EventLog,
    MediumEvents,
    medium_of,
)

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_IDLE_S = 0.05  # the publisher's longest sleep between two looks at the log and the replay socket
_LINGER_MS = 500  # what a closing socket may still take to send its last batch


def encode_event(event: Event, block_size: int) -> list[Any]:
    """One event as vLLM's array-like msgspec struct (the tag first)."""
    if event.kind == STORED:
        return [STORED, event.hashes, event.parent, [], block_size, None, event.medium]
    if event.kind == REMOVED:
        return [REMOVED, event.hashes, event.medium]
    return [CLEARED]


def encode_batch(events: Iterable[Event], block_size: int, ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, [encode_event(e, block_size) for e in events], None],
                         use_bin_type=True)


@dataclass(slots=True)
class PublisherStats:
    batches: int = 0  # messages sent
    replays: int = 0  # replay requests answered
    errors: int = 0  # sends that failed (the batch is lost; its sequence number is skipped)


class KVEventPublisher:
    """The thread that turns the log into messages; `start` binds, `close` sends what is left."""

    def __init__(self, log: EventLog, endpoint: str, block_size: int, topic: str = "",
                 replay_endpoint: str | None = None, keep_batches: int = 10_000, hwm: int = 100_000) -> None:
        self.log = log
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.block_size = block_size
        self.topic = topic.encode()
        self.hwm = hwm
        self.stats = PublisherStats()
        self.seq = 0  # the next message's sequence number
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=keep_batches)
        self._running = False
        self._sending = False  # between taking events off the log and sending them
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: str | None = None
        self.bound: str | None = None  # the endpoint as bound (a tcp://*:0 port resolved)
        self.replay_bound: str | None = None

    def start(self, timeout_s: float = 5.0) -> None:
        """Bind the sockets on the publisher thread; raises OSError with the reason if they cannot
        be bound (a port in use, a bad address)."""
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvgate-kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise OSError(f"KV events: the publisher did not bind {self.endpoint} within {timeout_s:g} s")
        if self._error is not None:
            self._thread.join(timeout_s)
            raise OSError(self._error)

    def _bind(self, ctx: zmq.Context[Any]) -> tuple[zmq.Socket[Any], zmq.Socket[Any] | None]:
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self.hwm)
        pub.linger = _LINGER_MS
        replay: zmq.Socket[Any] | None = None
        try:
            pub.bind(self.endpoint)
            self.bound = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.linger = 0
                replay.bind(self.replay_endpoint)
                self.replay_bound = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            pub.close(0)
            if replay is not None:
                replay.close(0)
            where = self.replay_endpoint if self.bound else self.endpoint
            raise OSError(f"KV events: cannot bind {where}: {exc} (set [events] endpoint to a free address, "
                          "e.g. tcp://*:5557, or leave it unset to publish no events)") from exc
        return pub, replay

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            pub, replay = self._bind(ctx)
        except OSError as exc:
            self._error = str(exc)
            self._ready.set()
            ctx.term()
            return
        self._ready.set()
        logger.info("KV events published at %s%s", self.bound,
                    f" (replay at {self.replay_bound})" if self.replay_bound else "")
        try:
            while self._running or len(self.log):
                self.log.wait(_IDLE_S)
                self._sending = True
                events = self.log.drain()
                if events:
                    self._send(pub, events)
                self._sending = False
                while replay is not None and replay.poll(0):
                    self._answer(replay)
        finally:
            pub.close()
            if replay is not None:
                replay.close()
            ctx.term()

    def _send(self, pub: zmq.Socket[Any], events: list[Event]) -> None:
        payload = encode_batch(events, self.block_size)
        seq = self.seq
        self.seq += 1
        try:
            pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError as exc:
            self.stats.errors += 1
            logger.warning("KV events: batch %d not sent (%s)", seq, exc)
            return
        self._kept.append((seq, payload))
        self.stats.batches += 1

    def _answer(self, replay: zmq.Socket[Any]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored (send [b'', start seq u64])", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._kept):
            if seq >= start:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
        self.stats.replays += 1

    @property
    def idle(self) -> bool:
        """Whether every event logged so far has been sent (or failed to be)."""
        return not self._sending and not len(self.log)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.idle:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what the log still holds, then close the sockets."""
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout_s)


class KVEvents:
    """The engine's events: one log, its publisher, and the sinks handed to the pool and tiers."""

    def __init__(self, endpoint: str, block_size: int, topic: str = "", max_queue: int = 100_000,
                 replay_endpoint: str | None = None) -> None:
        self.log = EventLog(max_queue)
        self.publisher = KVEventPublisher(self.log, endpoint, block_size, topic, replay_endpoint)
        self.endpoint = endpoint
        self.topic = topic
        self._wired: set[int] = set()  # ids of the tiers given a sink

    def start(self, pool: Any) -> None:
        """Bind, announce a fresh start (subscribers forget what this replica said before) and
        give the device pool its sink."""
        self.publisher.start()
        self.log.cleared()
        pool.events = MediumEvents(self.log, DEVICE_MEDIUM)

    def wire(self, tiers: Iterable[Any]) -> None:
        """Give every tier not yet wired its sink, and announce the blocks it already holds (a
        disk tier's files from before the start, or the blocks of a tier attached while serving)."""
        for tier in tiers:
            if id(tier) in self._wired or not hasattr(tier, "events"):
                continue
            sink = MediumEvents(self.log, medium_of(tier.traits.locality))
            tier.events = sink  # first: a block the I/O thread adds meanwhile may be announced twice, never missed
            sink.stored_all(list(tier.keys()) if hasattr(tier, "keys") else [])
            self._wired.add(id(tier))

    def unwire(self, tier: Any) -> None:
        """A detached tier: its blocks are no longer this replica's to serve."""
        if id(tier) not in self._wired:
            return
        self._wired.discard(id(tier))
        sink = tier.events
        tier.events = NO_EVENTS
        if hasattr(tier, "keys"):
            sink.removed_all(list(tier.keys()))

    def snapshot(self) -> dict[str, Any]:
        blocks: dict[str, dict[str, int]] = {}
        for (kind, medium), n in sorted(self.log.counts.items()):
            blocks.setdefault(kind, {})[medium or "all"] = n
        p = self.publisher
        return {"endpoint": p.bound or self.endpoint, "replay_endpoint": p.replay_bound, "topic": self.topic,
                "batches": p.stats.batches, "next_sequence": p.seq, "send_errors": p.stats.errors,
                "replays": p.stats.replays, "blocks": blocks, "queued": len(self.log), "idle": p.idle,
                "resyncs": self.log.resyncs, "dropped": self.log.dropped}

    def close(self) -> None:
        self.publisher.close()
