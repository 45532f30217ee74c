"""KVStorage: the preallocated KV tensor pool, laid out block-major so a block moves as one copy.

    kv[num_blocks, num_layers, 2 (K|V), block_size, num_kv_heads, head_dim]
        kv[b]           → every layer's K and V of block b: one contiguous run of bytes
        kv[:, l, 0]     → layer l's keys, a strided view the attention kernel indexes by slot

A tier (host, disk, remote) moves whole blocks: ``read_block`` / ``write_block`` copy one block
out to bytes and back with a single memcpy on CPU (a pinned staging buffer on CUDA).
"""

from __future__ import annotations

import torch


class KVStorage:
    """The device-resident KV pool; block ids index its first dimension."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv = torch.zeros(
            (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=self.device
        )
        self.block_shape = tuple(self.kv.shape[1:])
        self.block_nbytes = self.kv[0].numel() * self.kv.element_size()
        self._staging: torch.Tensor | None = None
        if self.device.type == "cuda":
            self._staging = torch.empty(self.block_nbytes, dtype=torch.uint8, pin_memory=True)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def keys(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys as [num_blocks, block_size, kv_heads, head_dim] (a view)."""
        return self.kv[:, layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[:, layer, 1]

    def block_view(self, block_id: int) -> torch.Tensor:
        """Block ``block_id``'s KV for all layers as a flat uint8 view (what tiers copy in and out)."""
        return self.kv[block_id].view(torch.uint8).reshape(-1)

    def read_block(self, block_id: int) -> bytes:
        """Copy one block's KV for all layers out as raw bytes (native dtype, C order)."""
        block = self.kv[block_id].view(torch.uint8).reshape(-1)
        if self._staging is not None:
            self._staging.copy_(block)
            return self._staging.numpy().tobytes()
        return block.numpy().tobytes()

    def write_block(self, block_id: int, data: bytes | bytearray | memoryview) -> None:
        """Copy raw bytes produced by ``read_block`` (same shape and dtype) into block ``block_id``."""
        view = memoryview(data).cast("B")
        if view.nbytes != self.block_nbytes:
            raise ValueError(f"block payload is {view.nbytes} bytes, expected {self.block_nbytes}")
        src = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
        self.kv[block_id].view(torch.uint8).reshape(-1).copy_(src)
