"""Block records: header + payload round trip, and every way a record can be wrong is rejected."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from cache.tiers.codec import HEADER_SIZE, MAGIC, VERSION, BlockFormat, CorruptBlockError, decode, encode

FP = bytes(range(32))
FMT = BlockFormat(FP, "float16", (2, 3, 4))  # 48 bytes of payload
KEY = bytes(range(100, 132))
PAYLOAD = bytes((i * 7 + 3) % 256 for i in range(FMT.payload_size))

# Byte offsets of the header fields ("<4sH16s8I32s32sQQH": packed, no alignment padding).
OFF_MAGIC = 0
OFF_VERSION = 4
OFF_DTYPE = 6
OFF_SHAPE = 22
OFF_FP = 54
OFF_HASH = 86
OFF_LEN = 118
OFF_SUM = 126
OFF_CODEC = 134


def record(fmt: BlockFormat = FMT, key: bytes = KEY, payload: bytes = PAYLOAD) -> bytes:
    return encode(fmt, key, payload)


def patched(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new):]


def test_header_layout_has_no_padding() -> None:
    assert HEADER_SIZE == 4 + 2 + 16 + 8 * 4 + 32 + 32 + 8 + 8 + 2 == 136
    data = record()
    assert data[OFF_MAGIC:OFF_MAGIC + 4] == MAGIC
    assert struct.unpack_from("<H", data, OFF_VERSION)[0] == VERSION
    assert data[OFF_DTYPE:OFF_DTYPE + 16] == b"float16".ljust(16, b"\0")
    assert struct.unpack_from("<8I", data, OFF_SHAPE) == (2, 3, 4, 0, 0, 0, 0, 0)
    assert data[OFF_FP:OFF_FP + 32] == FP
    assert data[OFF_HASH:OFF_HASH + 32] == KEY
    assert struct.unpack_from("<Q", data, OFF_LEN)[0] == FMT.payload_size
    assert struct.unpack_from("<Q", data, OFF_SUM)[0] == xxh3_64_intdigest(PAYLOAD)
    assert struct.unpack_from("<H", data, OFF_CODEC)[0] == 0  # none
    assert data[HEADER_SIZE:] == PAYLOAD


def test_round_trip() -> None:
    data = record()
    assert len(data) == FMT.record_size == HEADER_SIZE + FMT.payload_size
    assert bytes(decode(FMT, KEY, data)) == PAYLOAD
    assert bytes(decode(FMT, KEY, memoryview(data))) == PAYLOAD
    assert bytes(decode(FMT, KEY, bytearray(data))) == PAYLOAD


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_round_trip_per_dtype(dtype: str, itemsize: int) -> None:
    fmt = BlockFormat(FP, dtype, (2, 1, 3, 5))
    assert fmt.payload_size == itemsize * 30
    payload = bytes(range(fmt.payload_size))
    assert bytes(decode(fmt, KEY, encode(fmt, KEY, payload))) == payload


def test_encode_accepts_memoryview_and_rejects_wrong_size() -> None:
    assert record(payload=memoryview(PAYLOAD)) == record()
    with pytest.raises(ValueError):
        encode(FMT, KEY, PAYLOAD[:-1])
    with pytest.raises(ValueError):
        encode(FMT, KEY, PAYLOAD + b"\0")


def test_format_validation() -> None:
    with pytest.raises(ValueError):
        BlockFormat(b"short", "float16", (1,))
    with pytest.raises(ValueError):
        BlockFormat(FP, "float16", (1,) * 9)
    with pytest.raises(ValueError):
        BlockFormat(FP, "x" * 17, (1,))


def test_truncated() -> None:
    data = record()
    for cut in (0, 1, HEADER_SIZE - 1, HEADER_SIZE, len(data) - 1):
        with pytest.raises(CorruptBlockError):
            decode(FMT, KEY, data[:cut])


def test_padded() -> None:
    with pytest.raises(CorruptBlockError, match="truncated or padded"):
        decode(FMT, KEY, record() + b"\0")


def test_bad_magic() -> None:
    with pytest.raises(CorruptBlockError, match="magic"):
        decode(FMT, KEY, patched(record(), OFF_MAGIC, b"KVGX"))


def test_wrong_version() -> None:
    with pytest.raises(CorruptBlockError, match="version"):
        decode(FMT, KEY, patched(record(), OFF_VERSION, struct.pack("<H", VERSION + 1)))


def test_foreign_fingerprint() -> None:
    other = BlockFormat(bytes(32), FMT.dtype, FMT.shape)
    with pytest.raises(CorruptBlockError, match="fingerprint"):
        decode(FMT, KEY, record(fmt=other))


def test_wrong_dtype() -> None:
    other = BlockFormat(FP, "bfloat16", FMT.shape)  # same payload size, another dtype
    assert other.payload_size == FMT.payload_size
    with pytest.raises(CorruptBlockError, match="dtype"):
        decode(FMT, KEY, record(fmt=other))


@pytest.mark.parametrize("shape", [(4, 3, 2), (2, 3, 4, 1), (2, 12), (6, 4)])
def test_wrong_shape(shape: tuple[int, ...]) -> None:
    other = BlockFormat(FP, FMT.dtype, shape)  # same number of elements, another layout
    assert other.payload_size == FMT.payload_size
    with pytest.raises(CorruptBlockError, match="shape"):
        decode(FMT, KEY, record(fmt=other))


def test_wrong_hash() -> None:
    with pytest.raises(CorruptBlockError, match="hash"):
        decode(FMT, bytes(32), record())


def test_wrong_length_field() -> None:
    data = patched(record(), OFF_LEN, struct.pack("<Q", FMT.payload_size - 1))
    with pytest.raises(CorruptBlockError):
        decode(FMT, KEY, data)


def test_flipped_payload_byte_fails_checksum() -> None:
    data = bytearray(record())
    data[HEADER_SIZE + 5] ^= 0x01
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode(FMT, KEY, bytes(data))


def test_flipped_checksum_byte_fails_checksum() -> None:
    data = bytearray(record())
    data[OFF_SUM] ^= 0x80
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode(FMT, KEY, bytes(data))


@settings(max_examples=300)
@given(payload=st.binary(min_size=FMT.payload_size, max_size=FMT.payload_size),
       data=st.data())
def test_any_single_corrupted_byte_is_rejected(payload: bytes, data: st.DataObject) -> None:
    """The header is packed without padding and every field (including the unused shape
    dimensions and the dtype's NUL fill) is checked, so no byte of a record is "don't care":
    changing any one of them must be rejected."""
    good = encode(FMT, KEY, payload)
    pos = data.draw(st.integers(0, len(good) - 1), label="pos")
    new = data.draw(st.integers(0, 255).filter(lambda b: b != good[pos]), label="new")
    bad = bytearray(good)
    bad[pos] = new
    with pytest.raises(CorruptBlockError):
        decode(FMT, KEY, bytes(bad))


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_byte_position_is_checked(mask: int) -> None:
    good = record()
    for pos in range(len(good)):
        bad = bytearray(good)
        bad[pos] ^= mask
        with pytest.raises(CorruptBlockError):
            decode(FMT, KEY, bytes(bad))
