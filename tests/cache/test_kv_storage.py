"""KVStorage: block-major layout, byte-exact block round trips, per-layer K/V views alias the pool."""

from __future__ import annotations

import warnings

import pytest
import torch

from cache.kv_storage import KVStorage

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
DTYPES = [torch.float32, torch.bfloat16]

# 3 blocks, 2 layers, 4 tokens a block, 2 KV heads of 8: one block is 2*2*4*2*8 = 256 elements.
NUM_BLOCKS, LAYERS, BLOCK, HEADS, DIM = 3, 2, 4, 2, 8


def make(dtype: torch.dtype = torch.float32, device: str = "cpu") -> KVStorage:
    return KVStorage(NUM_BLOCKS, LAYERS, BLOCK, HEADS, DIM, dtype=dtype, device=device)


def fill(storage: KVStorage, block_id: int, seed: int) -> None:
    values = torch.randn(storage.block_shape, generator=torch.Generator().manual_seed(seed))
    storage.kv[block_id].copy_(values.to(storage.dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-for-bit comparison (NaNs and -0.0 included)."""
    return t.contiguous().view(torch.uint8).cpu()


def test_layout_is_block_major() -> None:
    s = make()
    assert s.kv.shape == (3, 2, 2, 4, 2, 8)
    assert s.block_shape == (2, 2, 4, 2, 8)
    assert s.kv.is_contiguous()
    assert s.kv.stride(0) == 256  # a block is one contiguous run
    assert s.block_nbytes == 256 * 4
    assert s.nbytes == 3 * 256 * 4
    assert torch.count_nonzero(s.kv) == 0


@pytest.mark.parametrize(("dtype", "itemsize"), [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_block_nbytes_follows_dtype(dtype: torch.dtype, itemsize: int) -> None:
    s = make(dtype)
    assert s.kv.dtype == dtype
    assert s.block_nbytes == 256 * itemsize


def test_keys_and_values_shapes() -> None:
    s = make()
    for layer in range(LAYERS):
        assert s.keys(layer).shape == (3, 4, 2, 8)
        assert s.values(layer).shape == (3, 4, 2, 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_read_block_is_the_block_in_c_order(dtype: torch.dtype, device: str) -> None:
    s = make(dtype, device)
    fill(s, 1, seed=1)
    data = s.read_block(1)
    assert isinstance(data, bytes)
    assert len(data) == s.block_nbytes
    assert data == bits(s.kv[1]).numpy().tobytes()
    assert s.read_block(0) == bytes(s.block_nbytes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_block_round_trips_bit_for_bit(dtype: torch.dtype, device: str) -> None:
    s = make(dtype, device)
    fill(s, 0, seed=0)
    s.kv[0, 1, 0, 2, 1, 3] = float("nan")
    s.kv[0, 0, 1, 0, 0, 0] = -0.0
    s.write_block(2, s.read_block(0))
    assert torch.equal(bits(s.kv[2]), bits(s.kv[0]))
    assert torch.count_nonzero(bits(s.kv[1])) == 0  # neighbours untouched
    assert s.read_block(2) == s.read_block(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_block_moves_between_pools(dtype: torch.dtype) -> None:
    src, dst = make(dtype), make(dtype)
    fill(src, 2, seed=3)
    dst.write_block(0, src.read_block(2))
    assert torch.equal(bits(dst.kv[0]), bits(src.kv[2]))


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_write_block_accepts_bytes_like(wrap: type) -> None:
    s = make()
    fill(s, 0, seed=5)
    payload = s.read_block(0)
    s.write_block(1, wrap(payload) if wrap is not memoryview else memoryview(bytearray(payload)))
    assert s.read_block(1) == payload


def test_write_block_from_a_read_only_memoryview_does_not_warn() -> None:
    s = make()
    fill(s, 0, seed=6)
    payload = s.read_block(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.write_block(1, memoryview(payload))
    assert s.read_block(1) == payload


def test_write_block_measures_a_typed_memoryview_in_bytes() -> None:
    s = make()
    fill(s, 0, seed=7)
    payload = s.read_block(0)
    typed = memoryview(bytearray(payload)).cast("f")  # 256 items, 1024 bytes
    s.write_block(1, typed)  # type: ignore[arg-type]  # memoryview[int] in the annotation: same bug
    assert s.read_block(1) == payload


@pytest.mark.parametrize("size_delta", [-1, 1, -1024])
def test_write_block_rejects_wrong_length(size_delta: int) -> None:
    s = make()
    with pytest.raises(ValueError, match=f"block payload is {1024 + size_delta} bytes, expected 1024"):
        s.write_block(0, bytes(1024 + size_delta))
    assert torch.count_nonzero(s.kv) == 0


def test_read_block_returns_a_copy() -> None:
    s = make()
    data = s.read_block(0)
    s.kv[0].fill_(1.0)
    assert data == bytes(s.block_nbytes)


@pytest.mark.parametrize("layer", range(LAYERS))
def test_keys_and_values_views_alias_the_pool(layer: int) -> None:
    s = make()
    keys, values = s.keys(layer), s.values(layer)
    assert keys.untyped_storage().data_ptr() == s.kv.untyped_storage().data_ptr()
    keys[2, 3, 1, 5] = 7.0
    values[2, 0, 0, 1] = -3.0
    assert s.kv[2, layer, 0, 3, 1, 5] == 7.0
    assert s.kv[2, layer, 1, 0, 0, 1] == -3.0
    block = torch.frombuffer(bytearray(s.read_block(2)), dtype=torch.float32).reshape(s.block_shape)
    assert block[layer, 0, 3, 1, 5] == 7.0
    assert block[layer, 1, 0, 0, 1] == -3.0
    assert torch.count_nonzero(block) == 2
    assert torch.count_nonzero(s.kv[:2]) == 0


def test_write_block_shows_through_the_views() -> None:
    s = make()
    fill(s, 0, seed=8)
    s.write_block(1, s.read_block(0))
    for layer in range(LAYERS):
        assert torch.equal(s.keys(layer)[1], s.kv[0, layer, 0])
        assert torch.equal(s.values(layer)[1], s.kv[0, layer, 1])


def test_spare_rows_extend_the_tensor_for_a_host_tier_sharing_it() -> None:
    storage = KVStorage(NUM_BLOCKS, LAYERS, BLOCK, HEADS, DIM, spare_rows=2)
    assert storage.num_blocks == NUM_BLOCKS and storage.num_rows == NUM_BLOCKS + 2
    assert storage.nbytes == NUM_BLOCKS * storage.block_nbytes  # the pool's bytes; spare rows are the host's
    assert list(storage.spare()) == [3, 4]
    assert storage.keys(1).shape[0] == NUM_BLOCKS + 2  # attention indexes any row
    assert torch.count_nonzero(storage.kv[:NUM_BLOCKS]) == 0
    slab = storage.slab()
    assert slab.shape == (NUM_BLOCKS + 2, storage.block_nbytes) and slab.dtype == torch.uint8
    fill(storage, 4, seed=9)
    assert torch.equal(slab[4], bits(storage.kv[4]).reshape(-1))  # a view: the host tier sees the pool's writes
    slab[0].copy_(slab[4])
    assert torch.equal(bits(storage.kv[0]), bits(storage.kv[4]))


def test_spare_rows_only_on_cpu() -> None:
    with pytest.raises(ValueError, match="only on CPU"):
        KVStorage(NUM_BLOCKS, LAYERS, BLOCK, HEADS, DIM, device="cuda", spare_rows=1)
    with pytest.raises(ValueError, match="only on CPU"):
        KVStorage(NUM_BLOCKS, LAYERS, BLOCK, HEADS, DIM, spare_rows=-1)
