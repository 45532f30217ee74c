"""Sequence: one choice of one request as the scheduler tracks it (tokens, progress, hashes)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cache.hashing import BlockHash, extend_block_hashes
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class SequenceStatus(enum.Enum):
    LOADING = "loading"  # its prefix is being read from disk; not yet in the scheduler
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Token ids (prompt then output), how many have KV computed, and their block hashes.

    ``num_computed_tokens`` counts tokens whose KV is in the pool; a step computes the next
    ``num_tokens - num_computed_tokens`` (or a chunk of them) and samples once it catches up.
    ``tenant`` names who asked ("" = anonymous): the scheduler shares slots and blocks by it.
    """

    seq_id: str
    request_id: str
    index: int
    token_ids: list[int]
    params: SamplingParams
    root_hash: BlockHash
    block_size: int
    generator: torch.Generator | None = None
    prompt_len: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    tenant: str = ""
    switch: tuple[int, BlockHash] | None = None  # a public prefix's length in blocks, and the tenant's root
    lower_blocks: int = 0  # blocks brought up from the tiers below the device for it while it waited
    fetched: list[tuple[str, int]] = field(default_factory=list)  # of those, what its prefetch read, per tier

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.prompt_len = len(self.token_ids)
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def public_blocks(self) -> int:
        """Leading blocks hashed in the public namespace (a declared public prefix)."""
        return self.switch[0] if self.switch is not None else 0

    def update_block_hashes(self) -> None:
        extend_block_hashes(self.block_hashes, self.root_hash, self.token_ids, self.block_size, self.switch)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            self.update_block_hashes()
