"""The on-disk / on-wire form of one KV block: a fixed header, then the raw bytes of the block.

    magic "KVGB" | version u16 | dtype (16 bytes) | shape (8 × u32) | model fingerprint (32)
    | block hash (32) | payload length u64 | XXH3-64 of the payload u64 | payload

A block is only ever handed back if every field matches what the reader expects: the same model
(fingerprint), dtype and block shape, the hash it was asked for, the full length and checksum.
Anything else — truncated, corrupt, another model's, another layout's — is `CorruptBlockError`,
and the tier that held it deletes it and counts a miss.

Version 2 checks the payload with XXH3-64 (``xxhash``) instead of version 1's CRC-32, which was
slower than reading the block from the page cache and so capped a disk load (docs/tiers.md,
"Figures behind the code"); XXH3 catches the same truncations, garbage and flipped bits.
Version-1 records are foreign to a version-2 reader: a miss, deleted (they are a cache).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from xxhash import xxh3_64_intdigest

MAGIC = b"KVGB"
VERSION = 2
_MAX_DIMS = 8
_HEADER = struct.Struct(f"<4sH16s{_MAX_DIMS}I32s32sQQ")
HEADER_SIZE = _HEADER.size


class CorruptBlockError(ValueError):
    """A stored block failed validation; it must never reach attention."""


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """What every block of one engine must look like: its model, dtype and per-block shape."""

    fingerprint: bytes
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes")
        if len(self.shape) > _MAX_DIMS:
            raise ValueError(f"block shape has more than {_MAX_DIMS} dimensions")
        if len(self.dtype.encode()) > 16:
            raise ValueError(f"dtype name {self.dtype!r} is longer than 16 bytes")

    @property
    def payload_size(self) -> int:
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        size = itemsize
        for dim in self.shape:
            size *= dim
        return size

    @property
    def record_size(self) -> int:
        return HEADER_SIZE + self.payload_size


def encode(fmt: BlockFormat, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    """Header + payload as one bytes object."""
    return encode_header(fmt, block_hash, payload) + memoryview(payload).cast("B").tobytes()


def encode_header(fmt: BlockFormat, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    """The header alone, for writers that send it and the payload without joining them."""
    view = memoryview(payload).cast("B")
    if view.nbytes != fmt.payload_size:
        raise ValueError(f"payload is {view.nbytes} bytes, the block format says {fmt.payload_size}")
    shape = list(fmt.shape) + [0] * (_MAX_DIMS - len(fmt.shape))
    return _HEADER.pack(MAGIC, VERSION, fmt.dtype.encode(), *shape, fmt.fingerprint, block_hash,
                        view.nbytes, xxh3_64_intdigest(view))


def decode(fmt: BlockFormat, block_hash: bytes, data: bytes | memoryview) -> memoryview:
    """The payload of a record, after checking every header field; raises `CorruptBlockError`."""
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptBlockError(f"record is {view.nbytes} bytes, shorter than the {HEADER_SIZE}-byte header")
    return check(fmt, block_hash, view[:HEADER_SIZE], view[HEADER_SIZE:], view.nbytes - HEADER_SIZE)


def check(fmt: BlockFormat, block_hash: bytes, header: memoryview, payload: memoryview, payload_read: int) -> memoryview:
    """Check a record read in two parts (a header, then ``payload_read`` bytes into ``payload``, as
    a scattered read into a destination slot does); returns the payload view or raises
    `CorruptBlockError`."""
    fields = _HEADER.unpack_from(header)
    magic, version, dtype, shape = fields[0], fields[1], fields[2], fields[3:3 + _MAX_DIMS]
    fingerprint, stored_hash, length, checksum = fields[3 + _MAX_DIMS:]
    if magic != MAGIC:
        raise CorruptBlockError("bad magic: not a KVGate block")
    if version != VERSION:
        raise CorruptBlockError(f"block format version {version}, expected {VERSION}")
    if fingerprint != fmt.fingerprint:
        raise CorruptBlockError("block belongs to another model, dtype or layout (fingerprint differs)")
    stored_dtype = dtype.rstrip(b"\0").decode(errors="replace")
    if stored_dtype != fmt.dtype:
        raise CorruptBlockError(f"block dtype {stored_dtype!r}, expected {fmt.dtype}")
    if tuple(d for d in shape[: len(fmt.shape)]) != fmt.shape or any(shape[len(fmt.shape):]):
        raise CorruptBlockError(f"block shape {tuple(d for d in shape if d)}, expected {fmt.shape}")
    if stored_hash != block_hash:
        raise CorruptBlockError("block was stored under another hash")
    if length != fmt.payload_size or payload_read != length:
        raise CorruptBlockError(f"record holds {payload_read} payload bytes, expected "
                                f"{fmt.payload_size} (truncated or padded)")
    payload = payload[:length]
    if xxh3_64_intdigest(payload) != checksum:
        raise CorruptBlockError("checksum mismatch: the payload is corrupt")
    return payload
