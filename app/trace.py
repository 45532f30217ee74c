"""The request trace: a bounded ring of anonymised records, exported in the Mooncake trace layout.

Every generation prompt the engine ran appends one record when its request ends: its arrival
time, prompt and output lengths, and a chain of block hashes. Block `i`'s hash covers the
tenant's namespace salt, the request's `cache_salt` and every prompt token up to the end of
block `i`, so two prompts get the same hash at `i` exactly when the KV cache could share that
block between them (same namespace, same tokens so far)::

    root  = blake2b(namespace salt, cache_salt)
    h[i]  = blake2b(h[i-1] || token ids of block i)        (the last, partial block too)

Hashes are kept at a fine granularity `g = gcd(KV block size, 512)`, so an export can use
512-token blocks (Mooncake's, the default) or the server's own KV block size (a replay then
reproduces the cache's sharing exactly): block `j` of a `B = m*g`-token export is the fine hash
that ends where it ends, `h[min((j+1)*m, n) - 1]`.

An export (`export_lines`) holds no token, text, tenant name, key or salt: each distinct hash
becomes a small integer in order of first appearance in that export, and times are milliseconds
from its first request. Each line is a plain Mooncake record::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

The ring lives in the API process and is only touched on the event loop: no locks.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MOONCAKE_BLOCK_TOKENS = 512
CAPACITY = 10_000  # records kept: the most recent requests
MAX_HASH_BYTES = 64 << 20  # and at most this much hash data (8 bytes per fine block), whichever is less
_DIGEST = 8


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One prompt the engine ran: arrival (`time.perf_counter()` seconds), lengths, fine hashes."""

    arrival_s: float
    input_length: int
    output_length: int
    hashes: bytes  # concatenated 8-byte chain hashes, one per `granularity` tokens (last one partial)


class TraceRing:
    """The most recent `capacity` records (and at most `max_hash_bytes` of hashes), oldest first."""

    def __init__(self, block_size: int = 16, capacity: int = CAPACITY,
                 max_hash_bytes: int = MAX_HASH_BYTES) -> None:
        if block_size <= 0 or capacity <= 0:
            raise ValueError("block_size and capacity must be positive")
        self.block_size = block_size
        self.granularity = math.gcd(block_size, MOONCAKE_BLOCK_TOKENS)
        self.capacity = capacity
        self.max_hash_bytes = max_hash_bytes
        self.dropped = 0
        self._records: deque[TraceRecord] = deque()
        self._hash_bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def record(self, arrival_s: float, tenant_salt: bytes, cache_salt: str | None,
               prompt_token_ids: Sequence[int], output_length: int) -> TraceRecord:
        """Append one prompt's record, dropping the oldest ones beyond the bounds."""
        entry = TraceRecord(arrival_s, len(prompt_token_ids), output_length,
                            chain_hashes(prompt_token_ids, self.granularity, tenant_salt, cache_salt))
        self._records.append(entry)
        self._hash_bytes += len(entry.hashes)
        while len(self._records) > self.capacity or (self._hash_bytes > self.max_hash_bytes
                                                     and len(self._records) > 1):
            self._hash_bytes -= len(self._records.popleft().hashes)
            self.dropped += 1
        return entry

    def snapshot(self, limit: int | None = None) -> list[TraceRecord]:
        """The records in arrival order; with `limit`, the last `limit` of them."""
        records = sorted(self._records, key=lambda r: r.arrival_s)
        return records[-limit:] if limit else records

    def check_block_tokens(self, block_tokens: int) -> str | None:
        """Why an export cannot use `block_tokens`, or None when it can."""
        if block_tokens <= 0 or block_tokens % self.granularity:
            return (f"block_tokens must be a positive multiple of {self.granularity} (the trace's "
                    f"granularity: gcd of the KV block size {self.block_size} and 512)")
        return None


def chain_hashes(token_ids: Sequence[int], granularity: int, tenant_salt: bytes,
                 cache_salt: str | None) -> bytes:
    """8-byte chain hashes of `token_ids` in blocks of `granularity` tokens, the last one partial."""
    salt = cache_salt.encode() if cache_salt is not None else b""
    previous = hashlib.blake2b(len(tenant_salt).to_bytes(4, "little") + tenant_salt
                               + (b"\x01" + salt if cache_salt is not None else b"\x00"),
                               digest_size=_DIGEST).digest()
    data = array("I", token_ids).tobytes()
    step = 4 * granularity
    out = bytearray()
    for start in range(0, len(data), step):
        previous = hashlib.blake2b(previous + data[start:start + step], digest_size=_DIGEST).digest()
        out += previous
    return bytes(out)


def block_hashes(record: TraceRecord, granularity: int, block_tokens: int) -> list[bytes]:
    """The record's hashes for `block_tokens`-token blocks (a multiple of `granularity`)."""
    fine = len(record.hashes) // _DIGEST
    per_block = block_tokens // granularity
    ends = [min((j + 1) * per_block, fine) for j in range(math.ceil(fine / per_block))]
    return [record.hashes[(end - 1) * _DIGEST:end * _DIGEST] for end in ends]


def export_lines(records: Iterable[TraceRecord], granularity: int,
                 block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[str]:
    """Mooncake JSON lines: ms from the first record, lengths, hash ids renumbered from 0."""
    ids: dict[bytes, int] = {}
    lines: list[str] = []
    start: float | None = None
    for record in records:
        if start is None:
            start = record.arrival_s
        hash_ids = [ids.setdefault(h, len(ids)) for h in block_hashes(record, granularity, block_tokens)]
        lines.append(json.dumps(mooncake_record(round((record.arrival_s - start) * 1000),
                                                record.input_length, record.output_length, hash_ids)))
    return lines


def mooncake_record(timestamp_ms: int, input_length: int, output_length: int,
                    hash_ids: list[int]) -> dict[str, Any]:
    """One line of the layout, keys in the public trace's order."""
    return {"timestamp": timestamp_ms, "input_length": input_length, "output_length": output_length,
            "hash_ids": hash_ids}


def trace_ring(app: Any) -> TraceRing:
    """The app's ring (`app.state.trace`), created on first use with the server's KV block size."""
    ring = getattr(app.state, "trace", None)
    if ring is None:
        ring = app.state.trace = TraceRing(block_size=app.state.settings.cache.block_size)
    return ring


def trace_recorder(request: Any, prompts: list[list[int]], salt: bytes,
                   cache_salt: str | None) -> Callable[[Any], None]:
    """A `Job.on_done` callback that records every prompt the engine ran (prompt tokens seen)."""
    arrival = getattr(request.state, "arrival", None) or time.perf_counter()
    app = request.app

    def on_done(job: Any) -> None:
        ring = trace_ring(app)
        for index, prompt in enumerate(prompts):
            if job.prompt_tokens[index] > 0:
                ring.record(arrival, salt, cache_salt, prompt, job.output_tokens(index))

    return on_done
