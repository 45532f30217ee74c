"""A KV event subscriber for tests, as a router would be: pyzmq + msgpack, nothing of KVGate's.

It connects a SUB socket, asks the replay socket for everything from sequence 0 (so whatever it
missed while connecting arrives too), drops duplicate sequence numbers, and folds the events
into what each medium holds, failing on anything a correct publisher never says: a block stored
twice in one medium without a removal between, a removal of a block it does not hold.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import msgpack
import zmq


class EventStream:
    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.next_seq = 0
        self.held: dict[str, set[bytes]] = {}
        self.counts: Counter[tuple[str, str]] = Counter()  # (kind, medium) → blocks
        self.clears = 0
        self.problems: list[str] = []
        self.block_size: int | None = None
        self.pending: dict[int, bytes] = {}  # live messages ahead of what was applied

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()

    def _replay_from(self, start: int) -> None:
        """Ask the replay socket for every kept batch from ``start`` (a DEALER: one request, many
        replies, each ``[b"", seq, payload]``, the last with seq -1)."""
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not req.poll(5000):
                    raise AssertionError("the replay socket did not answer in 5 s")
                _empty, seq_bytes, payload = req.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    return
                self.pending.setdefault(seq, payload)
        finally:
            req.close(0)

    def _apply_ready(self) -> None:
        while self.next_seq in self.pending:
            self._apply(msgpack.unpackb(self.pending.pop(self.next_seq), raw=False))
            self.next_seq += 1
        for seq in [s for s in self.pending if s < self.next_seq]:
            del self.pending[seq]

    def _apply(self, batch: list[Any]) -> None:
        ts, events, _rank = batch
        assert isinstance(ts, float)
        for event in events:
            kind = event[0]
            if kind == "AllBlocksCleared":
                self.held.clear()
                self.clears += 1
                continue
            if kind == "BlockStored":
                _, hashes, parent, token_ids, block_size, _lora, medium = event
                assert token_ids == [], "token ids must never be published"
                assert parent is None or len(parent) == 32
                self.block_size = block_size
                held = self.held.setdefault(medium, set())
                for h in hashes:
                    assert isinstance(h, bytes) and len(h) == 32
                    if h in held:
                        self.problems.append(f"{medium}: {h.hex()[:12]} stored twice")
                    held.add(h)
            elif kind == "BlockRemoved":
                _, hashes, medium = event
                held = self.held.setdefault(medium, set())
                for h in hashes:
                    if h not in held:
                        self.problems.append(f"{medium}: {h.hex()[:12]} removed but not held")
                    held.discard(h)
            else:
                raise AssertionError(f"unknown event {event!r}")
            self.counts[(kind, medium)] += len(hashes)

    def sync(self, until_seq: int, timeout_s: float = 10.0) -> None:
        """Receive (and replay what was missed) until every batch before ``until_seq`` is applied."""
        deadline = time.monotonic() + timeout_s
        replayed = False
        while self.next_seq < until_seq:
            if self.sub.poll(100):
                _topic, seq_bytes, payload = self.sub.recv_multipart()
                self.pending.setdefault(int.from_bytes(seq_bytes, "big"), payload)
            elif not replayed or self.next_seq not in self.pending:
                self._replay_from(self.next_seq)
                replayed = True
            self._apply_ready()
            if time.monotonic() > deadline:
                raise AssertionError(f"events up to {until_seq} not received in {timeout_s} s (at {self.next_seq})")
