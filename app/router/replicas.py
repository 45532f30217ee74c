"""The replicas behind the router: their health, what the router sent them, and the KV events that
keep each one's index (app/router/index.py) current.

    health loop (every interval): GET /ready ─ fails ×2 or a connection error: out of rotation
                                             └ answers again: GET /admin/replica; a new instance
                                               (a restart) resets its index and its event feed
    event feed (one task per replica): ZMQ SUB ─▶ in order by sequence ─▶ ReplicaIndex
                                       a gap ─▶ ask the replay socket; what it no longer keeps
                                       ─▶ clear the index (it then holds less, never more)
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgpack
import zmq
import zmq.asyncio

from app.router.index import ReplicaIndex

logger = logging.getLogger(__name__)

FAILURES_TO_REMOVE = 2
REPLAY_TIMEOUT_S = 2.0


@dataclass(slots=True)
class Replica:
    """One replica as the router sees it."""

    url: str
    events_endpoint: str | None = None  # given on the command line, else learnt from /admin/replica
    replay_endpoint: str | None = None
    index: ReplicaIndex = field(default_factory=ReplicaIndex)
    healthy: bool = False
    reason: str = "not checked yet"
    failures: int = 0  # consecutive failed health checks
    info: dict[str, Any] | None = None  # GET /admin/replica
    outstanding: int = 0  # tokens sent and not finished (the load in the score)
    in_flight: int = 0
    routed: int = 0
    errors: int = 0  # requests that failed to reach it (retried elsewhere)
    broken: int = 0  # answers it broke off after the router had begun relaying them (lost to the client)
    events: int = 0  # event batches applied
    gaps: int = 0  # sequence gaps seen
    replayed: int = 0  # batches recovered through the replay socket
    resets: int = 0  # index cleared: a gap the replay could not fill, a restart
    next_seq: int | None = None  # the next event batch expected (None: none seen yet)
    feed: asyncio.Task[None] | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    def snapshot(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "reason": self.reason,
                "model": (self.info or {}).get("model"), "instance": (self.info or {}).get("instance"),
                "events_endpoint": self.events_endpoint, "replay_endpoint": self.replay_endpoint,
                "outstanding_tokens": self.outstanding, "in_flight": self.in_flight, "routed": self.routed,
                "errors": self.errors, "broken": self.broken, "event_batches": self.events, "gaps": self.gaps,
                "replayed": self.replayed, "resets": self.resets, "index_blocks": self.index.blocks()}


def reachable(endpoint: str | None, host: str) -> str | None:
    """A bound endpoint as a subscriber elsewhere reaches it: ``tcp://*:5557`` or
    ``tcp://0.0.0.0:5557`` on a replica at ``host`` is ``tcp://host:5557``."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint
    address, _, port = endpoint[len("tcp://"):].rpartition(":")
    if address in ("*", "0.0.0.0", "[::]", "::", ""):
        address = host
    return f"tcp://{address}:{port}"


class EventFeed:
    """Keeps one replica's index from its KV events (a task on the router's event loop)."""

    def __init__(self, replica: Replica, ctx: zmq.asyncio.Context, topic: bytes = b"") -> None:
        self.replica = replica
        self.ctx = ctx
        self.topic = topic

    async def run(self) -> None:
        replica = self.replica
        assert replica.events_endpoint is not None
        sub = self.ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(replica.events_endpoint)
        try:
            while True:
                if not await sub.poll(1000):
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                await self.receive(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(0)

    async def receive(self, seq: int, payload: bytes) -> None:
        """One batch off the wire: applied in order, a gap filled from the replay socket first."""
        replica = self.replica
        expected = replica.next_seq
        if expected is not None and seq < expected:  # the publisher started again (a restart)
            self.reset("the replica's events started again")
            expected = None
        if expected is None:
            expected = 0
        if seq > expected:
            replica.gaps += 1
            missed = await self.replay(expected, seq)
            if missed is None or (missed and min(missed) != expected) or len(missed) < seq - expected:
                self.reset(f"events {expected}..{seq - 1} are no longer kept")
            else:
                for s in sorted(missed):
                    self.apply(missed[s])
                replica.replayed += len(missed)
        self.apply(payload)
        replica.next_seq = seq + 1

    def apply(self, payload: bytes) -> None:
        try:
            _ts, events, *_ = msgpack.unpackb(payload, raw=False)
            for event in events:
                self.replica.index.apply(event)
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            logger.warning("router: an event batch of %s could not be read (%s); its index is cleared",
                           self.replica.url, exc)
            self.reset("an unreadable event batch")
            return
        self.replica.events += 1

    def reset(self, why: str) -> None:
        replica = self.replica
        replica.index.clear()
        replica.resets += 1
        logger.info("router: index of %s cleared (%s)", replica.url, why)

    async def replay(self, start: int, stop: int) -> dict[int, bytes] | None:
        """Batches ``start``..``stop - 1`` from the replay socket, or None without one (or no answer)."""
        endpoint = self.replica.replay_endpoint
        if not endpoint:
            return None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(endpoint)
        got: dict[int, bytes] = {}
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await dealer.poll(int(left * 1000)):
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:
                    return got
                if start <= seq < stop:
                    got[seq] = frames[2]
        finally:
            dealer.close(0)


class Replicas:
    """Every replica, their health loop and their event feeds."""

    def __init__(self, urls: list[str], events: list[str | None], admin_key: str | None,
                 interval_s: float = 1.0, topic: str | None = None) -> None:
        self.replicas = [Replica(url.rstrip("/"), events_endpoint=ev) for url, ev in zip(urls, events, strict=True)]
        self.admin_key = admin_key
        self.interval_s = interval_s
        self.topic = topic
        self.ctx = zmq.asyncio.Context()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(2.0))
        self._health: asyncio.Task[None] | None = None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    async def start(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))
        self._health = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for replica, outcome in zip(self.replicas, await asyncio.gather(
                    *(self.check(r) for r in self.replicas), return_exceptions=True), strict=True):
                if isinstance(outcome, Exception):  # a check must never end the loop
                    logger.warning("router: health check of %s failed: %r", replica.url, outcome)
                    self.failed(replica, f"health check error: {type(outcome).__name__}", count=1)

    async def check(self, replica: Replica) -> None:
        """One health check: /ready, and /admin/replica when it comes (back) into rotation."""
        try:
            ready = await self.client.get(replica.url + "/ready")
            if ready.status_code != 200:
                raise RuntimeError(f"/ready answered {ready.status_code}")
            if not replica.healthy:
                await self._learn(replica)
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            self.failed(replica, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, count=1)
            return
        replica.failures = 0
        if not replica.healthy:
            logger.info("router: %s is in rotation", replica.url)
        replica.healthy, replica.reason = True, "ready"

    def failed(self, replica: Replica, reason: str, count: int = FAILURES_TO_REMOVE) -> None:
        """A failed check (one), or a request that could not reach it (out at once)."""
        replica.failures += count
        replica.reason = reason
        if replica.healthy and replica.failures >= FAILURES_TO_REMOVE:
            replica.healthy = False
            logger.warning("router: %s is out of rotation (%s)", replica.url, reason)

    async def _learn(self, replica: Replica) -> None:
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        response = await self.client.get(replica.url + "/admin/replica", headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"/admin/replica answered {response.status_code} (is [admin] api_key the "
                               "replicas' own?)")
        info = response.json()
        new_instance = replica.info is None or replica.info.get("instance") != info.get("instance")
        replica.info = info
        events = info.get("events") or {}
        endpoint = replica.events_endpoint or reachable(events.get("endpoint"), replica.host)
        replay = reachable(events.get("replay_endpoint"), replica.host)
        if new_instance or endpoint != replica.events_endpoint or replica.feed is None:
            self._restart_feed(replica, endpoint, replay, events.get("topic", ""))

    def _restart_feed(self, replica: Replica, endpoint: str | None, replay: str | None, topic: str) -> None:
        if replica.feed is not None:
            replica.feed.cancel()
            replica.feed = None
        replica.index.clear()
        replica.next_seq = None
        replica.events_endpoint, replica.replay_endpoint = endpoint, replay
        if endpoint:
            feed = EventFeed(replica, self.ctx, (self.topic if self.topic is not None else topic).encode())
            replica.feed = asyncio.create_task(feed.run(), name=f"kvgate-route-events-{replica.url}")
        else:
            logger.warning("router: %s publishes no KV events ([events] endpoint unset): it is routed by "
                           "load alone", replica.url)

    async def close(self) -> None:
        tasks = [t for t in (self._health, *(r.feed for r in self.replicas)) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()
        self.ctx.term()
