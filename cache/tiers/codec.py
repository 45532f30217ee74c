"""The on-disk / on-wire form of one KV block: a fixed header, then the block's encoded bytes.

    magic "KVGB" | version u16 | dtype (16 bytes) | shape (8 × u32) | model fingerprint (32)
    | block hash (32) | payload length u64 | XXH3-64 of the payload u64 | codec u16 | payload

A block is only ever handed back if every field matches what the reader expects: the same model
(fingerprint), dtype and block shape, the hash it was asked for, the full length and checksum.
Anything else — truncated, corrupt, another model's, another layout's — is `CorruptBlockError`,
and the tier that held it deletes it and counts a miss.

The payload is the block encoded with the record's codec (kv_codec.py: none, bf16, fp16, int8);
dtype and shape are the decoded block's, the length is the encoded payload's, and the checksum
covers the encoded bytes, seeded with the codec id, so a flipped codec field fails it too. A
reader decodes whatever codec a record says, whatever its own tier is set to write; an id it
does not know is `UndecodableBlockError` (a miss, counted apart from corrupt records).

Version 2 checked the payload with XXH3-64 (``xxhash``) instead of version 1's CRC-32, which was
slower than reading the block from the page cache and so capped a disk load (docs/tiers.md,
"Figures behind the code"); version 3 adds the codec. Records of older versions are foreign: a
miss, deleted (they are a cache).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy
from xxhash import xxh3_64_intdigest

from cache.tiers import kv_codec
from cache.tiers.kv_codec import CODECS

MAGIC = b"KVGB"
VERSION = 3
_MAX_DIMS = 8
_HEADER = struct.Struct(f"<4sH16s{_MAX_DIMS}I32s32sQQH")
HEADER_SIZE = _HEADER.size


class CorruptBlockError(ValueError):
    """A stored block failed validation; it must never reach attention."""


class UndecodableBlockError(CorruptBlockError):
    """A stored block names a codec this reader does not know."""


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
        """Bytes of one block as the engine holds it (decoded)."""
        return kv_codec.encoded_size("none", self.dtype, self.shape)

    @property
    def record_size(self) -> int:
        """Bytes of one record of a block stored as it is (codec none)."""
        return HEADER_SIZE + self.payload_size

    def encoded_size(self, codec: str) -> int:
        return kv_codec.encoded_size(codec, self.dtype, self.shape)

    def record_size_of(self, codec: str) -> int:
        """Bytes of one record of a block encoded with ``codec``."""
        return HEADER_SIZE + self.encoded_size(codec)


def encode(fmt: BlockFormat, block_hash: bytes, payload: bytes | memoryview, codec: str = "none") -> bytes:
    """Header + encoded payload as one bytes object."""
    header, body = encode_record(fmt, block_hash, payload, codec)
    return header + body.tobytes()


def encode_record(fmt: BlockFormat, block_hash: bytes, payload: bytes | memoryview,
                  codec: str = "none") -> tuple[bytes, memoryview]:
    """The header and the encoded payload, apart (writers send them without joining them); for
    ``none`` the payload is the caller's buffer itself. Runs off the step loop."""
    view = memoryview(payload).cast("B")
    if view.nbytes != fmt.payload_size:
        raise ValueError(f"payload is {view.nbytes} bytes, the block format says {fmt.payload_size}")
    body = kv_codec.encode(codec, fmt.dtype, fmt.shape, view)
    return encode_header(fmt, block_hash, body, codec), body


def encode_header(fmt: BlockFormat, block_hash: bytes, body: bytes | memoryview, codec: str = "none") -> bytes:
    """The header alone of a record whose payload is ``body`` (already encoded with ``codec``)."""
    view = memoryview(body).cast("B")
    if view.nbytes != fmt.encoded_size(codec):
        raise ValueError(f"payload is {view.nbytes} bytes, the block format says {fmt.encoded_size(codec)} "
                         f"for codec {codec}")
    codec_id = CODECS.index(codec)
    shape = list(fmt.shape) + [0] * (_MAX_DIMS - len(fmt.shape))
    return _HEADER.pack(MAGIC, VERSION, fmt.dtype.encode(), *shape, fmt.fingerprint, block_hash,
                        view.nbytes, xxh3_64_intdigest(view, seed=codec_id), codec_id)


def decode(fmt: BlockFormat, block_hash: bytes, data: bytes | memoryview, into: memoryview | None = None) -> memoryview:
    """The block of a record, after checking every header field; raises `CorruptBlockError`.
    A ``none`` record's payload is a view of ``data``; another codec's is decoded into ``into``
    (or a fresh buffer)."""
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptBlockError(f"record is {view.nbytes} bytes, shorter than the {HEADER_SIZE}-byte header")
    return check(fmt, block_hash, view[:HEADER_SIZE], view[HEADER_SIZE:], view.nbytes - HEADER_SIZE, into)


def check(fmt: BlockFormat, block_hash: bytes, header: memoryview, payload: memoryview, payload_read: int,
          into: memoryview | None = None) -> memoryview:
    """Check a record read in two parts (a header, then ``payload_read`` bytes into ``payload``, as
    a scattered read into a destination slot does) and return its block: for ``none`` the payload
    view, else the payload decoded into ``into`` (or a fresh buffer). Raises `CorruptBlockError`."""
    codec, body = parse(fmt, block_hash, header, payload, payload_read)
    return body if codec == "none" else decode_payload(fmt, codec, body, into)


def decode_payload(fmt: BlockFormat, codec: str, body: memoryview, into: memoryview | None = None) -> memoryview:
    """``body`` (a checked payload encoded with ``codec``) decoded into ``into`` (or a fresh
    buffer); for ``none`` a copy."""
    dest = into if into is not None else numpy.empty(fmt.payload_size, dtype=numpy.uint8).data
    if _address(body) == _address(dest):  # read in place (a 16-bit block, a 16-bit codec): decode a copy
        body = memoryview(bytearray(body))
    return kv_codec.decode_into(codec, fmt.dtype, fmt.shape, body, dest)


def _address(buf: memoryview) -> int:
    return int(numpy.frombuffer(buf, dtype=numpy.uint8).ctypes.data) if buf.nbytes else 0


def parse(fmt: BlockFormat, block_hash: bytes, header: memoryview, payload: memoryview,
          payload_read: int) -> tuple[str, memoryview]:
    """Check every header field and the checksum; the record's codec and its encoded payload."""
    fields = _HEADER.unpack_from(header)
    magic, version, dtype, shape = fields[0], fields[1], fields[2], fields[3:3 + _MAX_DIMS]
    fingerprint, stored_hash, length, checksum, codec_id = fields[3 + _MAX_DIMS:]
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
    if codec_id >= len(CODECS):
        raise UndecodableBlockError(f"block encoded with codec id {codec_id}, which this reader does not know")
    codec = CODECS[codec_id]
    expected = fmt.encoded_size(codec)
    if length != expected or payload_read != length:
        raise CorruptBlockError(f"record holds {payload_read} payload bytes, expected "
                                f"{expected} for codec {codec} (truncated or padded)")
    payload = payload[:length]
    if xxh3_64_intdigest(payload, seed=codec_id) != checksum:
        raise CorruptBlockError("checksum mismatch: the payload is corrupt")
    return codec, payload
