"""KVStorage: the preallocated KV tensor pool, laid out block-major so a block moves as one copy.

    kv[num_blocks, num_layers, 2 (K|V), block_size, num_kv_heads, head_dim]
        kv[b]           → every layer's K and V of block b: one contiguous run of bytes
        kv[:, l, 0]     → layer l's keys, a strided view the attention kernel indexes by slot

A tier (host, disk, remote) moves whole blocks: ``read_block`` / ``write_block`` copy one block
out to bytes and back with a single memcpy on CPU (a pinned staging buffer on CUDA).

On CPU the pool can carry ``spare_rows`` beyond its ``num_blocks``: rows that the host tier keeps
its blocks in (`slab`). Device and host memory are then one tensor, and a block moves between
the two tiers by trading rows — nothing is copied (docs/tiers.md, "One slab on CPU"). The first
dimension is therefore a *row*, not a block id: the pool's blocks each name the row they use.
Spare rows are allocated but not touched: their pages are faulted in as the host tier fills.
"""

from __future__ import annotations

import torch


class KVStorage:
    """The device-resident KV pool; rows (a block's ``slot``) index its first dimension."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        spare_rows: int = 0,
    ) -> None:
        if spare_rows < 0 or spare_rows and torch.device(device).type != "cpu":
            raise ValueError(f"spare_rows must be 0 or positive, and only on CPU (got {spare_rows} on {device})")
        self.num_blocks = num_blocks
        self.num_rows = num_blocks + spare_rows
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv = torch.empty(
            (self.num_rows, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=self.device
        )
        self.kv[:num_blocks].zero_()
        self.block_shape = tuple(self.kv.shape[1:])
        self.block_nbytes = self.kv[0].numel() * self.kv.element_size()
        self._staging: torch.Tensor | None = None
        if self.device.type == "cuda":
            self._staging = torch.empty(self.block_nbytes, dtype=torch.uint8, pin_memory=True)

    @property
    def nbytes(self) -> int:
        """The device pool's bytes (spare rows not counted: they are the host tier's)."""
        return self.num_blocks * self.block_nbytes

    def slab(self) -> torch.Tensor:
        """Every row as a flat uint8 row, [num_rows, block_nbytes] (a view): the host tier's slab."""
        return self.kv.view(torch.uint8).view(self.num_rows, self.block_nbytes)

    def spare(self) -> range:
        """The rows past the pool's own (what a host tier sharing the slab starts with)."""
        return range(self.num_blocks, self.num_rows)

    def keys(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys as [num_rows, block_size, kv_heads, head_dim] (a view)."""
        return self.kv[:, layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[:, layer, 1]

    def block_view(self, row: int) -> torch.Tensor:
        """Row ``row``'s KV for all layers as a flat uint8 view (what tiers copy in and out)."""
        return self.kv[row].view(torch.uint8).reshape(-1)

    def read_block(self, row: int) -> bytes:
        """Copy one block's KV for all layers out as raw bytes (native dtype, C order)."""
        block = self.kv[row].view(torch.uint8).reshape(-1)
        if self._staging is not None:
            self._staging.copy_(block)
            return self._staging.numpy().tobytes()
        return block.numpy().tobytes()

    def write_block(self, row: int, data: bytes | bytearray | memoryview) -> None:
        """Copy raw bytes produced by ``read_block`` (same shape and dtype) into row ``row``."""
        view = memoryview(data).cast("B")
        if view.nbytes != self.block_nbytes:
            raise ValueError(f"block payload is {view.nbytes} bytes, expected {self.block_nbytes}")
        src = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
        self.kv[row].view(torch.uint8).reshape(-1).copy_(src)
