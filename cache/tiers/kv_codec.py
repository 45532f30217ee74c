"""KV codecs: how a block's bytes are stored below host memory (`[cache.disk|remote] codec`).

    none   the block's own bytes (float32: 4 bytes per value); lossless, zero-copy
    bf16   each value cast to bfloat16 (2 bytes; relative error at most 2^-8)
    fp16   each value cast to float16 (2 bytes; relative error at most 2^-11 within its range,
           values past ±65504 saturate to ±65504)
    int8   [scales: float32 (groups, kv_heads)] [values: int8 (groups, tokens, kv_heads, head_dim)]
           symmetric absmax per (layer, K|V, kv head) over the block's tokens and head_dim:
           value = round(x · 127 / absmax), x ≈ value · absmax / 127 (error at most absmax / 254;
           a group whose absmax is below 2^-100 is stored as zeros)

A block of the engine's layout (layers, 2, tokens, kv_heads, head_dim) is scaled per (layer, K|V,
kv head); a block of any other shape (tests' small formats) gets one scale. Encoding runs on the
writer and sender threads, decoding on the I/O side straight into the destination slot; both are
torch ops on views of the bytes (``torch.frombuffer``), cut into pieces of fewer than
`_GRAIN` values so that torch runs each on the calling thread and never wakes its intra-op
threads, which belong to the step loop. Figures: docs/tiers.md, "Codecs".
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator

import numpy
import torch

from cache.tiers.options import CODECS

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
_FP16_MAX = 65504.0
# int8: a group whose values all lie below this is stored as zeros (its scale would underflow)
_TINY = 2.0 ** -100
# torch runs an op of fewer values than this (at::internal::GRAIN_SIZE) on the calling thread
_GRAIN = 32768


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(CODECS)}, got {codec!r}")
    return codec


def _groups(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The block as (groups, tokens, kv_heads, head_dim): groups = layers × (K|V) for the
    engine's 5-dimensional layout; one group of one head otherwise."""
    if len(shape) == 5:
        layers, kv, tokens, heads, dim = shape
        return layers * kv, tokens, heads, dim
    return 1, math.prod(shape), 1, 1


def encoded_size(codec: str, dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a block of ``dtype`` and ``shape`` encoded with ``codec``."""
    n = math.prod(shape)
    if codec == "none":
        return n * _TORCH[dtype].itemsize
    if codec in _CAST:
        return 2 * n
    if codec == "int8":
        groups, _, heads, _ = _groups(shape)
        return 4 * groups * heads + n
    raise ValueError(f"unknown codec {codec!r}")


def _tensor(buf: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor over ``buf``'s bytes, no copy. torch wants a writable buffer even to read
    one; a read-only one (a block copied out as ``bytes``) is viewed through its address: the
    tensor is only read, and only while the caller holds ``buf``."""
    view = memoryview(buf).cast("B")
    if view.readonly:
        address = numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data
        view = memoryview((ctypes.c_ubyte * view.nbytes).from_address(address)).cast("B")
    return torch.frombuffer(view, dtype=dtype) if view.nbytes else torch.empty(0, dtype=dtype)


def _pieces(groups: int, per_group: int) -> Iterator[slice]:
    step = max(1, (_GRAIN - 1) // max(1, per_group))
    for start in range(0, groups, step):
        yield slice(start, min(groups, start + step))


def encode(codec: str, dtype: str, shape: tuple[int, ...], payload: bytes | memoryview) -> memoryview:
    """``payload`` (a block of ``dtype`` and ``shape``) encoded with ``codec``: for ``none`` the
    payload itself, else a fresh buffer of `encoded_size` bytes."""
    if codec == "none":
        return memoryview(payload).cast("B")
    groups, tokens, heads, dim = _groups(shape)
    src = _tensor(payload, _TORCH[dtype]).view(groups, tokens, heads, dim)
    out = torch.empty(encoded_size(codec, dtype, shape), dtype=torch.uint8)
    if codec in _CAST:
        dst = out.view(_CAST[codec]).view(groups, tokens, heads, dim)
        for part in _pieces(groups, tokens * heads * dim):
            dst[part].copy_(src[part])
            if codec == "fp16":  # out-of-range values became ±inf: saturate them (NaN stays NaN)
                dst[part].clamp_(-_FP16_MAX, _FP16_MAX)
    elif codec == "int8":
        scales = out[: 4 * groups * heads].view(torch.float32).view(groups, heads)
        values = out[4 * groups * heads:].view(torch.int8).view(groups, tokens, heads, dim)
        for part in _pieces(groups, tokens * heads * dim):
            _int8_encode(src[part].float(), scales[part], values[part])
    else:
        raise ValueError(f"unknown codec {codec!r}")
    return out.numpy().data


def _int8_encode(x: torch.Tensor, scales: torch.Tensor, values: torch.Tensor) -> None:
    """Quantize ``x`` (groups, tokens, heads, dim) into ``values`` with one scale per (group, head)."""
    absmax = x.abs().amax(dim=(1, 3))
    if not bool(torch.isfinite(absmax).all()):  # never in a healthy cache: NaN → 0, ±inf saturate
        finite = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        bound = finite.abs().amax(dim=(1, 3), keepdim=True)
        x = torch.maximum(torch.minimum(torch.nan_to_num(x, nan=0.0), bound), -bound)
        absmax = bound.squeeze(3).squeeze(1)
    live = absmax >= _TINY
    scale = torch.where(live, absmax / 127, torch.zeros_like(absmax))
    scales.copy_(scale)
    divisor = torch.where(live, scale, torch.ones_like(scale))  # a dead group's values round to 0
    values.copy_((x / divisor[:, None, :, None]).round_().clamp_(-127, 127))


def decode_into(codec: str, dtype: str, shape: tuple[int, ...], body: bytes | memoryview,
                dest: memoryview) -> memoryview:
    """Decode ``body`` (encoded with ``codec``) into ``dest``, a writable buffer of the block's
    size; returns ``dest``."""
    groups, tokens, heads, dim = _groups(shape)
    out = _tensor(dest, _TORCH[dtype]).view(groups, tokens, heads, dim)
    per_group = tokens * heads * dim
    if codec == "none":
        src = _tensor(body, _TORCH[dtype]).view(groups, tokens, heads, dim)
        for part in _pieces(groups, per_group):
            out[part].copy_(src[part])
    elif codec in _CAST:
        src = _tensor(body, _CAST[codec]).view(groups, tokens, heads, dim)
        for part in _pieces(groups, per_group):
            out[part].copy_(src[part])
    elif codec == "int8":
        raw = _tensor(body, torch.uint8)
        scales = raw[: 4 * groups * heads].view(torch.float32).view(groups, heads)
        values = raw[4 * groups * heads:].view(torch.int8).view(groups, tokens, heads, dim)
        for part in _pieces(groups, per_group):
            torch.mul(values[part], scales[part][:, None, :, None], out=out[part])
    else:
        raise ValueError(f"unknown codec {codec!r}")
    return dest
