"""RemoteTier: KV blocks in Redis (or Redis Cluster), shared by every replica on the same store.

    key   kvgate:<model fingerprint hex>:<block hash hex>      (no token ids, no text, no tenant)
    value a seal (nonce + Poly1305 tag, `store_mac`) + a `codec` record (header + payload), with a TTL

Values are written with the tier's codec (`kv_codec`, encoded on the sender thread) and read
whatever codec they carry: ``none`` straight into the host slot, others decoded into it on arrival.

All calls are coroutines for the chain's I/O loop, batched in pipelines (one round trip for the
existence check of a whole prompt, one for its loads, one per batch of writes). A slow or dead
Redis must never fail or stall a request: every batch has a timeout, and a circuit breaker opens
after ``failures_to_open`` consecutive failures — for ``open_s`` seconds every call answers
"miss" at once — then lets one probe through; a success closes it again. Corrupt or foreign
records are misses, deleted and counted; so are records whose seal does not verify under the
deployment's store key (`unauthentic`: planted or altered by another writer, or written with
another server secret), checked before a byte of them is handed back.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from cache.telemetry import AccessPattern, BlockLife
from cache.tiers.base import TierTraits
from cache.tiers.breaker import CircuitBreaker
from cache.tiers.codec import (
    HEADER_SIZE,
    BlockFormat,
    CorruptBlockError,
    UndecodableBlockError,
    check,
    decode,
    encode_header,
    encode_record,
)
from cache.tiers.kv_codec import check_codec
from cache.tiers.options import safe_url
from cache.tiers.resp import GetPipe, RespError, SetPipe, endpoint
from cache.tiers.stats import RateEstimate, TierStats
from cache.tiers.store_mac import MAC_NAME, SEAL_SIZE, StoreMac, UnauthenticBlockError

logger = logging.getLogger(__name__)

# Writes go out in pipelines of about this many bytes: one pipeline's encoding and copies run on
# the I/O loop without a break, so a whole prompt's write-through in one pipeline would hold
# every lookup and load behind it (docs/tiers.md, "Figures behind the code").
WRITE_PIPELINE_BYTES = 4 << 20
READ_PIPELINE_BYTES = 8 << 20  # a load of many blocks: pipelines of about this much, one after the other

WRITE_MODES = ("through", "back", "selective")


class RemoteTier:
    name = "remote"
    traits = TierTraits(locality="remote", lifetime="persistent", substrate="network", shared=True, role="shared")

    def __init__(self, url: str, fmt: BlockFormat, ttl_s: int = 86400, cluster: bool = False,
                 timeout_s: float = 0.5, failures_to_open: int = 3, open_s: float = 5.0,
                 write_mode: str = "through", codec: str = "none", *, mac_key: bytes) -> None:
        """``write_mode``: "through" sends blocks when computed, "back" when they leave host memory,
        "selective" once a request reuses them; ``codec``: how blocks are encoded when written
        (any codec is read); ``mac_key``: the deployment's store key (32 bytes, the same on every
        replica: `tenants.registry.store_mac_key` of the server secret), which seals what is
        written and checks what is read. There is no unsealed mode: a tier without it is refused."""
        if write_mode not in WRITE_MODES:
            raise ValueError(f"write must be one of {', '.join(WRITE_MODES)}, got {write_mode!r}")
        self._mac = StoreMac(mac_key, fmt.fingerprint)
        self.write_mode = write_mode
        self.codec = check_codec(codec)
        self.record_size = SEAL_SIZE + fmt.record_size_of(codec)  # bytes of one value written here
        self.url = url
        self.fmt = fmt
        self.ttl_s = ttl_s
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.prefix = f"kvgate:{fmt.fingerprint.hex()}:"
        self.breaker = CircuitBreaker(failures_to_open, open_s)
        self.stats = TierStats()
        self.rate = RateEstimate(bytes_per_s=300e6, latency_s=1e-3)
        self.capacity_blocks = 0  # bounded by Redis (maxmemory) and the TTL, not by KVGate
        self.policy_name = "ttl"
        self.exists_checks = 0
        self.exists_time_s = 0.0
        self.access = AccessPattern()  # op and batch sizes, read/write mix (gap metric 1)
        self.life = BlockLife(max_tracked=65536)  # keys this replica wrote or read; Redis expires them itself
        self._client: Any = None
        where = None if cluster else endpoint(url)
        self._gets = GetPipe(where, timeout_s, max_value=SEAL_SIZE + fmt.record_size) if where is not None else None
        self._sets = SetPipe(where, timeout_s) if where is not None else None
        # where SetPipe sends write payloads (the chain's sender thread, below the step loop's
        # priority); None: on the I/O loop itself
        self.write_executor: Executor | None = None
        self._logged = False
        # owner → (opaque tag, quota in blocks or None): who is accounted in Redis (see `put`)
        self._accounts: dict[str, tuple[str, int | None]] = {}
        self._tracked: set[str] = set()  # owners accounted without a quota too (`track_owner`)
        self.quota_evictions = 0
        # block hashes a quota deleted (I/O loop appends, step loop drains: the chain forgets it sent them)
        self.unstored: collections.deque[bytes] = collections.deque(maxlen=65536)

    def apply_quota(self, owner: str, tag: str, blocks: int | None) -> None:
        """Account ``owner``'s writes under ``tag`` and keep at most ``blocks`` of them (None: no
        quota; an owner that is tracked stays counted, see `track_owner`)."""
        if blocks is None and owner not in self._tracked:
            self.drop_account(owner)
        else:
            self.set_account(owner, tag, blocks)

    def track_owner(self, owner: str, tag: str) -> None:
        """Account ``owner``'s writes under ``tag`` even without a quota (count only), so that
        `delete_owner` can find every block it wrote; a quota already set stays."""
        self._tracked.add(owner)
        if owner not in self._accounts:
            self._accounts[owner] = (tag, None)

    def describe(self) -> dict[str, Any]:
        return {"url": self.safe_url(), "cluster": self.cluster,
                "label": "remote Redis Cluster" if self.cluster else "",
                "breaker": self.breaker.state, "breaker_trips": self.breaker.trips, "write": self.write_mode,
                "codec": self.codec, "mac": MAC_NAME,
                "exists_checks": self.exists_checks, "exists_time_s": self.exists_time_s,
                "quota": {"accounted_owners": self.accounted_owners, "quota_evictions": self.quota_evictions}}

    def key(self, block_hash: bytes) -> str:
        return self.prefix + block_hash.hex()

    def __len__(self) -> int:
        return 0  # unknown without a scan; see stats

    @property
    def nbytes(self) -> int:
        return 0

    def _connect(self) -> Any:
        if self._client is None:
            kwargs: dict[str, Any] = dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s)
            if self.cluster:
                from redis.asyncio.cluster import RedisCluster

                self._client = RedisCluster.from_url(self.url, **kwargs)
            else:
                from redis.asyncio import Redis

                self._client = Redis.from_url(self.url, **kwargs)
        return self._client

    async def _run(self, build: Any) -> list[Any] | None:
        """Run one redis-py pipeline under the timeout and the breaker; None = failed (counted)."""

        async def execute() -> Any:
            pipe = self._connect().pipeline(transaction=False)
            build(pipe)
            return await pipe.execute()

        return await self._guarded(execute)

    async def _guarded(self, call: Any) -> list[Any] | None:
        """Await ``call()`` under the timeout and the breaker; None = failed (counted)."""
        if not self.breaker.allow():
            return None
        try:
            result = await asyncio.wait_for(call(), self.timeout_s)
        except Exception as exc:  # timeouts, connection refused, cluster errors: all degrade to a miss
            self.stats.errors += 1
            was_closed = self.breaker.state == "closed"
            self.breaker.failure()
            if was_closed and self.breaker.state == "open" or not self._logged:
                self._logged = True
                logger.warning("remote cache %s unavailable (%s: %s); requests recompute, breaker %s",
                               self.safe_url(), type(exc).__name__, exc, self.breaker.state)
            await self._reset()
            return None
        self.breaker.success()
        return list(result)

    async def _reset(self) -> None:
        if self._gets is not None:
            self._gets.close()
        if self._sets is not None:
            self._sets.close()
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.aclose(), self.timeout_s)
            except Exception:  # a dead connection may fail to close; it is dropped either way
                pass

    def safe_url(self) -> str:
        return safe_url(self.url)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` the store holds (one pipelined round trip); all False when down."""
        if not keys:
            return []
        t0 = time.perf_counter()
        result = await self._run(lambda pipe: [pipe.exists(self.key(k)) for k in keys])
        self.exists_checks += 1
        self.exists_time_s += time.perf_counter() - t0
        key_bytes = len(keys) * (len(self.prefix) + 2 * len(keys[0]))
        self.stats.metadata_bytes += key_bytes + len(keys)  # the keys out, one integer per key back
        self.access.observe("exists", len(keys), key_bytes)
        if result is None:
            return [False] * len(keys)
        return [bool(r) for r in result]

    async def get(self, keys: Sequence[bytes], dests: Sequence[memoryview | None] = ()) -> list[memoryview | None]:
        """Payloads for ``keys`` (None for a miss, an invalid record, or a store that is down).
        ``dests[i]``, where given, is a writable buffer of one payload's size (a host slot): the
        payload of ``keys[i]`` is received straight into it and the result is that buffer (over
        redis-py, for TLS and Cluster, copied into it here, on the I/O loop), or None. Records
        are checked as they arrive (resp.py), seal and checksum of one while the next is
        received, and a record of another codec than none is decoded into its destination there;
        a destination whose record fails is not handed back (None)."""
        if not keys:
            return []
        t0 = time.perf_counter()
        stored = [0] * len(keys)  # bytes of each record as stored (encoded)
        largest = SEAL_SIZE + self.fmt.record_size  # a sealed record of codec none

        def verify(i: int, data: Any) -> memoryview | CorruptBlockError | None:
            if data is None:
                return None
            try:
                if isinstance(data, tuple):  # received as (seal + header, the destination)
                    head, body = data
                    stored[i] = head.nbytes + body.nbytes
                    self._mac.check(keys[i], head[:SEAL_SIZE], head[SEAL_SIZE:], body)
                    return check(self.fmt, keys[i], head[SEAL_SIZE:], body, body.nbytes, into=body)
                stored[i] = len(data)
                if stored[i] > largest:  # no record is this long: not worth a tag (GetPipe reads past these)
                    raise UnauthenticBlockError(f"value of {stored[i]} bytes, longer than any sealed record")
                record = self._mac.open(keys[i], data)  # the seal first: nothing unsealed is parsed
                dest = dests[i] if i < len(dests) else None
                payload = decode(self.fmt, keys[i], record, into=dest)  # none: a view of the reply, no copy
                if dest is None or payload is dest:
                    return payload
                dest[:] = payload
                return dest
            except Exception as exc:  # runs inside the reply reader: it must not raise
                return exc if isinstance(exc, CorruptBlockError) else CorruptBlockError(f"unreadable record ({exc})")

        result: list[Any] = []
        per = max(1, READ_PIPELINE_BYTES // largest)  # each pipeline under the timeout on its own
        for start in range(0, len(keys), per):
            part = await self._get_pipeline(keys[start:start + per], dests[start:start + per],
                                            lambda i, data, start=start: verify(start + i, data))
            if part is None:  # failed (counted): the blocks after it continue no prefix
                result.extend([None] * (len(keys) - start))
                break
            result.extend(part)
        elapsed = time.perf_counter() - t0
        out: list[memoryview | None] = []
        bad: list[bytes] = []
        unauthentic = 0
        nbytes = 0  # as stored
        delivered = 0  # decoded: the load-rate estimate counts blocks' bytes, as predictions do
        for key, got, size in zip(keys, result, stored, strict=True):
            if isinstance(got, UnauthenticBlockError):  # logged once for the batch, below
                unauthentic += 1
                self.stats.unauthentic += 1
                self.stats.misses += 1
                bad.append(key)
                out.append(None)
            elif isinstance(got, CorruptBlockError):
                logger.warning("remote cache: block %s is unusable (%s); deleted", key.hex()[:16], got)
                if isinstance(got, UndecodableBlockError):
                    self.stats.undecodable += 1
                else:
                    self.stats.corrupt += 1
                self.stats.misses += 1
                bad.append(key)
                out.append(None)
            elif got is None:
                self.stats.misses += 1
                out.append(None)
            else:
                out.append(got)
                nbytes += size
                delivered += HEADER_SIZE + got.nbytes
                self.stats.hits += 1
                self.life.accessed(key)
        self.stats.reads += 1
        self.stats.read_time_s += elapsed
        self.stats.bytes_read += nbytes
        found = sum(o is not None for o in out)
        self.stats.metadata_bytes += len(keys) * (len(self.prefix) + 2 * len(keys[0])) + found * (SEAL_SIZE + HEADER_SIZE)
        self.access.observe("get", len(keys), nbytes)
        if delivered:
            self.rate.observe(delivered, elapsed, ops=len(keys))
        if unauthentic:
            logger.warning("remote cache %s: %d of %d records failed authentication (planted or altered in the "
                           "store, or written by a server with another secret); deleted, their tokens are "
                           "recomputed", self.safe_url(), unauthentic, len(keys))
        if bad:
            await self._run(lambda pipe: [pipe.delete(self.key(k)) for k in bad])
        return out

    async def _get_pipeline(self, keys: Sequence[bytes], dests: Sequence[memoryview | None],
                            verify: Any) -> list[Any] | None:
        """One pipeline of GETs, each reply through ``verify(i, reply)``; None if it failed."""
        if self._gets is not None:  # values received in place (resp.py); redis-py for the rest
            gets = self._gets
            head = SEAL_SIZE + HEADER_SIZE
            return await self._guarded(lambda: gets.get([self.key(k) for k in keys], dests, head, verify))
        result = await self._run(lambda pipe: [pipe.get(self.key(k)) for k in keys])
        return None if result is None else [verify(i, data) for i, data in enumerate(result)]

    def set_account(self, owner: str, tag: str, limit: int | None) -> None:
        """Account ``owner``'s writes in Redis under ``tag`` (opaque: Redis never sees a tenant's
        name), keeping at most ``limit`` of its blocks (None: count only)."""
        self._accounts[owner] = (tag, limit)

    @property
    def accounted_owners(self) -> int:
        return len(self._accounts)

    def drop_account(self, owner: str) -> None:
        self._accounts.pop(owner, None)

    def account_key(self, tag: str) -> str:
        return f"{self.prefix}owner:{tag}"

    async def put(self, items: Sequence[tuple[bytes, bytes]], owner: str = "") -> int:
        """Store blocks with the TTL (pipelines of about `WRITE_PIPELINE_BYTES`, one after the other,
        so lookups and loads interleave); returns how many were sent successfully (a pipeline
        that fails drops it and the rest, counted).

        An accounted owner's block keys also go into a sorted set by write time, shared by every
        replica on the store; past its quota its oldest blocks are deleted (a quota of 0 stores
        nothing). Entries older than the TTL are trimmed from the set as their blocks expire.
        """
        account = self._accounts.get(owner)
        if account is not None and account[1] == 0:
            return 0
        sent_keys: list[str] = []
        per = max(1, WRITE_PIPELINE_BYTES // max(1, self.record_size))
        for start in range(0, len(items), per):  # the I/O loop is free between pipelines
            chunk = items[start:start + per]
            names = [self.key(k) for k, _ in chunk]
            t0 = time.perf_counter()
            parts = await encode_records(self.fmt, self.codec, chunk, self.write_executor, self._mac)
            if self._sets is not None:  # seal, header and payload sent from where they lie (resp.py)
                records = [(name, list(part)) for name, part in zip(names, parts, strict=True)]
                result = await self._guarded(lambda records=records: self._set_all(records))
            else:
                joined = [(name, seal + header + body.tobytes())
                          for name, (seal, header, body) in zip(names, parts, strict=True)]
                result = await self._run(lambda pipe, joined=joined: [pipe.set(k, v, ex=self.ttl_s) for k, v in joined])
            if result is None:
                self.stats.dropped += len(items) - start
                self.unstored.extend(k for k, _ in items[start:])
                break
            self.stats.puts += len(chunk)
            self.stats.writes += 1
            self.stats.write_time_s += time.perf_counter() - t0
            key_bytes = sum(len(name) for name in names)
            sent = key_bytes + len(chunk) * self.record_size  # records as stored (encoded)
            self.stats.bytes_written += sent - key_bytes
            self.stats.metadata_bytes += key_bytes + len(chunk) * (SEAL_SIZE + HEADER_SIZE)
            self.access.observe("put", len(chunk), sent)
            for key, _ in chunk:
                self.life.inserted(key)
            sent_keys += names
        if account is not None and sent_keys:
            await self._account(account[0], account[1], sent_keys)
        return len(sent_keys)

    async def _set_all(self, records: list[tuple[str, list[Any]]]) -> list[Any]:
        """SET every record with the TTL; an error reply (Redis out of memory, a read-only
        replica) fails the whole batch, as it does through redis-py's pipeline."""
        assert self._sets is not None
        replies = await self._sets.set(records, self.ttl_s, executor=self.write_executor)
        for reply in replies:
            if isinstance(reply, RespError):
                raise reply
        return replies

    async def _account(self, tag: str, limit: int | None, keys: list[str]) -> None:
        zkey = self.account_key(tag)
        now = time.time()
        counted = await self._run(lambda pipe: [
            pipe.zadd(zkey, dict.fromkeys(keys, now)),
            pipe.zremrangebyscore(zkey, "-inf", now - self.ttl_s),
            pipe.expire(zkey, self.ttl_s),
            pipe.zcard(zkey)])
        if counted is None or limit is None or counted[-1] <= limit:
            return
        popped = await self._run(lambda pipe: [pipe.zpopmin(zkey, counted[-1] - limit)])
        victims = [member.decode() if isinstance(member, bytes) else member for member, _ in (popped or [[]])[0]]
        if victims and await self._run(lambda pipe: [pipe.delete(v) for v in victims]) is not None:
            self.quota_evictions += len(victims)
            self.stats.evictions += len(victims)
            self.unstored.extend(bytes.fromhex(v[len(self.prefix):]) for v in victims if v.startswith(self.prefix))

    async def delete(self, keys: Sequence[bytes], tag: str | None = None) -> int | None:
        """Delete the blocks ``keys`` (and their entries in the account ``tag``, if given) in one
        pipeline; how many existed, or None when the store did not answer. Their hashes go to
        `unstored`, so the chain sends them again when they are next computed."""
        if not keys:
            return 0
        names = [self.key(k) for k in keys]

        def build(pipe: Any) -> None:
            for name in names:
                pipe.delete(name)
            if tag is not None:
                pipe.zrem(self.account_key(tag), *names)

        result = await self._run(build)
        if result is None:
            return None
        self.unstored.extend(keys)
        return sum(int(bool(n)) for n in result[:len(names)])

    async def delete_owner(self, tag: str, batch: int = 512) -> int | None:
        """Delete every block accounted to ``tag`` (`track_owner`, quotas), whichever replica wrote
        it, and the account itself; how many blocks existed, or None when the store did not answer
        (what was deleted before stays deleted). Blocks written while no account was kept (a
        replica of an older version) are not found."""
        zkey = self.account_key(tag)
        listed = await self._run(lambda pipe: [pipe.zrange(zkey, 0, -1)])
        if listed is None:
            return None
        names = [m.decode() if isinstance(m, bytes) else str(m) for m in listed[0]]
        deleted = 0
        for start in range(0, len(names), batch):
            chunk = names[start:start + batch]
            result = await self._run(lambda pipe, chunk=chunk: [pipe.delete(name) for name in chunk])
            if result is None:
                return None
            deleted += sum(int(bool(n)) for n in result)
            self.unstored.extend(bytes.fromhex(n[len(self.prefix):]) for n in chunk if n.startswith(self.prefix))
        if await self._run(lambda pipe: [pipe.zrem(zkey, *names)] if names else [pipe.exists(zkey)]) is None:
            return None
        return deleted

    async def close(self) -> None:
        await self._reset()


async def encode_records(fmt: BlockFormat, codec: str, chunk: Sequence[tuple[bytes, bytes | memoryview]],
                         executor: Executor | None, mac: StoreMac) -> list[tuple[bytes, bytes, memoryview]]:
    """Each block's seal, header and payload, apart (sent without joining them); a codec's
    encoding runs on a thread of ``executor`` (the chain's sender thread), never on the I/O loop
    nor the step loop."""

    def sealed(k: bytes, header: bytes, body: memoryview) -> tuple[bytes, bytes, memoryview]:
        return mac.seal(k, header, body), header, body

    if codec == "none":  # the payload as it lies: only the checksum and the tag to compute (~14 GB/s)
        return [sealed(k, encode_header(fmt, k, p), memoryview(p).cast("B")) for k, p in chunk]

    def encode_all() -> list[tuple[bytes, bytes, memoryview]]:
        return [sealed(k, *encode_record(fmt, k, p, codec)) for k, p in chunk]

    return await asyncio.get_running_loop().run_in_executor(executor, encode_all)
