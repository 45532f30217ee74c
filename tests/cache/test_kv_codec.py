"""KV codecs (cache/tiers/kv_codec.py): sizes, round trips within each codec's error bound, int8's
scale per (layer, K|V, kv head), fp16's saturation, and records that carry their codec."""

from __future__ import annotations

import struct

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cache.tiers import kv_codec
from cache.tiers.codec import (
    HEADER_SIZE,
    BlockFormat,
    CorruptBlockError,
    UndecodableBlockError,
    decode,
    encode,
    parse,
)

FP = bytes(range(32))
SHAPE = (3, 2, 4, 3, 8)  # layers, K|V, tokens, kv heads, head_dim
FMT = BlockFormat(FP, "float32", SHAPE)
KEY = bytes(range(100, 132))
OFF_CODEC = HEADER_SIZE - 2


def block(seed: int = 0, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    """Values of very different magnitudes per (layer, K|V, head), as a KV cache has."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    return x * torch.logspace(-2, 2, shape[0] * shape[1] * shape[3]).view(shape[0], shape[1], 1, shape[3], 1)


def round_trip(codec: str, x: torch.Tensor, fmt: BlockFormat = FMT) -> torch.Tensor:
    body = kv_codec.encode(codec, fmt.dtype, fmt.shape, x.numpy().tobytes())
    assert body.nbytes == kv_codec.encoded_size(codec, fmt.dtype, fmt.shape)
    out = numpy.empty(fmt.payload_size, dtype=numpy.uint8)
    kv_codec.decode_into(codec, fmt.dtype, fmt.shape, body, out.data)
    return torch.from_numpy(out).view(torch.float32).view(x.shape)


def test_sizes_of_a_smollm2_block() -> None:
    shape = (30, 2, 16, 3, 64)  # SmolLM2-135M: 720 KiB per float32 block
    sizes = {c: kv_codec.encoded_size(c, "float32", shape) for c in kv_codec.CODECS}
    assert sizes == {"none": 737280, "bf16": 368640, "fp16": 368640, "int8": 184320 + 30 * 2 * 3 * 4}


def test_none_is_the_block_itself() -> None:
    x = block()
    payload = x.numpy().tobytes()
    assert bytes(kv_codec.encode("none", "float32", SHAPE, payload)) == payload
    assert torch.equal(round_trip("none", x), x)


def test_bf16_relative_error_at_most_2_to_the_minus_8() -> None:
    x = block(1)
    err = ((round_trip("bf16", x) - x).abs() / x.abs()).max().item()
    assert err <= 2.0 ** -8


def test_fp16_relative_error_at_most_2_to_the_minus_11_within_range() -> None:
    x = block(2).clamp(-60000, 60000)
    x = torch.where(x.abs() < 2.0 ** -14, torch.full_like(x, 2.0 ** -14), x)  # fp16's normal range
    err = ((round_trip("fp16", x) - x).abs() / x.abs()).max().item()
    assert err <= 2.0 ** -11


def test_fp16_saturates_out_of_range_values() -> None:
    x = torch.zeros(SHAPE)
    x.view(-1)[:4] = torch.tensor([1e6, -1e6, 70000.0, float("inf")])
    y = round_trip("fp16", x).view(-1)
    assert y[:4].tolist() == [65504.0, -65504.0, 65504.0, 65504.0]
    assert torch.isfinite(y).all()


def test_int8_error_at_most_absmax_over_127_per_head() -> None:
    x = block(3)
    y = round_trip("int8", x)
    absmax = x.abs().amax(dim=(2, 4), keepdim=True)  # per (layer, K|V, head)
    assert ((y - x).abs() <= absmax / 127 + 1e-6 * absmax).all()


def test_int8_zero_and_non_finite_groups() -> None:
    x = torch.zeros(SHAPE)
    assert torch.equal(round_trip("int8", x), x)  # a zero group: scale 0, no NaN
    x = block(4)
    x[0, 0, 0, 0, 0] = float("nan")
    x[1, 1, 0, 2, 0] = float("inf")
    y = round_trip("int8", x)
    assert torch.isfinite(y).all()
    assert y[0, 0, 0, 0, 0] == 0


@settings(max_examples=60, deadline=None)
@given(values=hnp.arrays(numpy.float32, SHAPE, elements=st.floats(-1e4, 1e4, width=32)),
       gains=hnp.arrays(numpy.float32, (SHAPE[0], SHAPE[1], SHAPE[3]),
                        elements=st.sampled_from([0.0, 1e-3, 1.0, 1e3])))
def test_int8_scales_each_layer_kv_and_head_by_its_own_absmax(values: numpy.ndarray, gains: numpy.ndarray) -> None:
    x = torch.from_numpy(values) * torch.from_numpy(gains).view(SHAPE[0], SHAPE[1], 1, SHAPE[3], 1)
    body = kv_codec.encode("int8", "float32", SHAPE, x.numpy().tobytes())
    groups, heads = SHAPE[0] * SHAPE[1], SHAPE[3]
    scales = torch.frombuffer(bytearray(body[: 4 * groups * heads]), dtype=torch.float32).view(SHAPE[0], SHAPE[1], heads)
    absmax = x.abs().amax(dim=(2, 4))
    live = absmax >= 2.0 ** -100  # below: stored as zeros (documented)
    assert torch.equal(scales[~live], torch.zeros_like(scales[~live]))
    assert torch.allclose(scales[live], absmax[live] / 127, rtol=1e-6, atol=0)
    q = torch.frombuffer(bytearray(body[4 * groups * heads:]), dtype=torch.int8).view(SHAPE)
    peak = q.abs().amax(dim=(2, 4))  # the largest value of each live group maps to ±127
    assert torch.equal(peak[live], torch.full_like(peak[live], 127))
    y = round_trip("int8", x)
    assert ((y - x).abs() <= (absmax / 127)[:, :, None, :, None] * (1 + 1e-5) + 2.0 ** -100).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("codec", kv_codec.CODECS)
def test_16_bit_blocks_round_trip_through_records(dtype: str, codec: str) -> None:
    fmt = BlockFormat(FP, dtype, SHAPE)
    x = block(5).to(getattr(torch, dtype))
    payload = x.view(torch.uint8).numpy().tobytes()
    y = torch.frombuffer(bytearray(decode(fmt, KEY, encode(fmt, KEY, payload, codec))), dtype=x.dtype).view(SHAPE)
    assert torch.allclose(y.float(), x.float(), rtol=2 ** -7, atol=x.float().abs().max().item() / 127)


@pytest.mark.parametrize("codec", kv_codec.CODECS)
def test_record_carries_its_codec_and_its_encoded_length(codec: str) -> None:
    x = block(6)
    data = encode(FMT, KEY, x.numpy().tobytes(), codec)
    assert len(data) == FMT.record_size_of(codec) == HEADER_SIZE + kv_codec.encoded_size(codec, "float32", SHAPE)
    assert struct.unpack_from("<H", data, OFF_CODEC)[0] == kv_codec.CODECS.index(codec)
    assert parse(FMT, KEY, memoryview(data)[:HEADER_SIZE], memoryview(data)[HEADER_SIZE:],
                 len(data) - HEADER_SIZE)[0] == codec
    out = numpy.empty(FMT.payload_size, dtype=numpy.uint8)
    y = decode(FMT, KEY, data, into=out.data)
    assert numpy.frombuffer(y, dtype=numpy.uint8).ctypes.data == out.ctypes.data or codec == "none"


def test_checksum_covers_the_encoded_bytes_and_the_codec() -> None:
    data = bytearray(encode(FMT, KEY, block(7).numpy().tobytes(), "bf16"))
    flipped = bytearray(data)
    flipped[HEADER_SIZE + 3] ^= 0x01
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode(FMT, KEY, bytes(flipped))
    f16 = BlockFormat(FP, "float16", SHAPE)  # bf16 and fp16 records of it have the same length
    rec = bytearray(encode(f16, KEY, block(7).half().numpy().tobytes(), "bf16"))
    struct.pack_into("<H", rec, OFF_CODEC, kv_codec.CODECS.index("fp16"))
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode(f16, KEY, bytes(rec))


def test_an_unknown_codec_is_undecodable() -> None:
    data = bytearray(encode(FMT, KEY, block(8).numpy().tobytes(), "int8"))
    struct.pack_into("<H", data, OFF_CODEC, 0x81)
    with pytest.raises(UndecodableBlockError):
        decode(FMT, KEY, bytes(data))


def test_reads_a_read_only_payload_without_copying_it_first() -> None:
    x = block(9)
    payload = x.numpy().tobytes()  # bytes: read-only
    assert bytes(kv_codec.encode("bf16", "float32", SHAPE, payload)) == x.bfloat16().view(torch.uint8).numpy().tobytes()
