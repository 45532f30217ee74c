"""Paged attention for transformers models: reads and writes KV through block tables.

The runner flattens a step's tokens into one row (batch 1, T tokens: decodes first, then
prefill chunks) and passes an ``AttentionMetadata`` as the ``kvgate`` keyword argument, which
transformers forwards to the registered attention function of every layer. Per layer:

    1. write the T new K/V rows into their slots:  kv[block, layer, K|V, offset] = k/v
    2. with the native CPU kernels (engine.kernels), which read K/V in place in the pool
       (``PagedRows``): decodes and short prefill chunks in one call of ``paged_attention``,
       longer prefill chunks (cached prefix or not) in one call of ``chunk_attention``
    3. otherwise decodes: one batched SDPA over their gathered block tables, padded, masked by length
    4. prefills: one SDPA each over the chunk's queries and its whole context (cached + new)

All writes of a layer happen before any read, so a sequence may hit blocks that another
sequence in the same step is computing (n > 1 siblings, identical prompts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cache.kv_storage import KVStorage

ATTN_IMPLEMENTATION = "kvgate_paged"
# The few-row kernel takes prefill chunks of up to this many rows (past it the chunk kernel, or
# PyTorch's flash attention, is faster) and cuts contexts into splits of this many keys (a
# split's K/V stay in L2). Both chosen by measurement: docs/engine.md.
KERNEL_MAX_ROWS = 8
KERNEL_SPLIT_TOKENS = 256
# The chunk kernel's units hold this many tiles of query rows (each K/V tile is read once for
# all of them); more tiles per unit leave too few units to share between threads.
CHUNK_ROW_TILES = 2
# It compares positions as float32: spans with longer contexts take PyTorch's path.
CHUNK_MAX_CONTEXT = 1 << 24


@dataclass(slots=True)
class PrefillSpan:
    """A multi-token chunk: flat token range [start, end) at positions [ctx_len - q_len, ctx_len).

    ``mask`` is None for a chunk with no cached prefix: it attends causally to its own fresh K/V;
    otherwise it is additive ([1, 1, q_len, ctx_len], 0 where a key is visible, -inf elsewhere).
    """

    start: int
    end: int
    ctx_len: int
    block_ids: torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class PagedRows:
    """Spans computed by one native kernel: span s owns query rows q_start[s]..q_start[s+1]-1 of
    the kernel's input, its context is ctx_lens[s] tokens in blocks tables[s]. Those rows are the
    step's flat rows ``first .. first + num_rows - 1``, or those ``index`` lists when not
    consecutive. ``op(q, k_cache, v_cache, tables, q_start, ctx_lens, scale)`` returns their
    attention, [num_rows, Hq, D]."""

    op: Callable[..., torch.Tensor]
    num_rows: int
    tables: torch.Tensor
    q_start: torch.Tensor
    ctx_lens: torch.Tensor
    first: int = 0
    index: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """Everything one step's attention needs, built once per step and shared by all layers."""

    storage: KVStorage
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    num_decodes: int = 0
    decode_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    paged: list[PagedRows] = field(default_factory=list)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvgate: AttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention over paged KV; ``query`` is [1, Hq, T, D], ``key``/``value`` [1, Hkv, T, D]."""
    if kvgate is None:
        raise RuntimeError("kvgate paged attention called without metadata; run the model through ModelRunner")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_new = key[0].transpose(0, 1)
    v_new = value[0].transpose(0, 1)
    write_kv(kvgate, layer, k_new, v_new)
    out = attend(kvgate, layer, query[0].transpose(0, 1), k_new, v_new, scaling)
    return out.unsqueeze(0), None


def write_kv(meta: AttentionMetadata, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store the step's new K/V rows ([T, Hkv, D] each) in their slots of layer ``layer``."""
    meta.storage.keys(layer)[meta.slot_blocks, meta.slot_offsets] = key
    meta.storage.values(layer)[meta.slot_blocks, meta.slot_offsets] = value


def attend(meta: AttentionMetadata, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float | None) -> torch.Tensor:
    """Attention of layer ``layer`` for every row of the step: ``query`` [T, Hq, D], the step's own
    ``key``/``value`` [T, Hkv, D] (already written to the pool); returns [T, Hq, D]."""
    k_cache = meta.storage.keys(layer)
    v_cache = meta.storage.values(layer)
    total, num_heads, head_dim = query.shape
    kv_heads = key.shape[1]
    if len(meta.paged) == 1 and not meta.num_decodes and not meta.prefills:  # one call has every row
        p = meta.paged[0]
        if p.index is None and p.first == 0 and p.num_rows == total:
            scale = scaling if scaling is not None else head_dim ** -0.5
            return p.op(query, k_cache, v_cache, p.tables, p.q_start, p.ctx_lens, scale)
    out = query.new_empty((total, num_heads, head_dim))
    for p in meta.paged:
        rows = slice(p.first, p.first + p.num_rows)
        q = query[rows] if p.index is None else query.index_select(0, p.index)
        scale = scaling if scaling is not None else head_dim ** -0.5
        o = p.op(q, k_cache, v_cache, p.tables, p.q_start, p.ctx_lens, scale)
        if p.index is None:
            out[rows] = o
        else:
            out.index_copy_(0, p.index, o)
    nd = meta.num_decodes
    if nd:
        assert meta.decode_tables is not None
        q = query[:nd].unsqueeze(2)
        flat = meta.decode_tables.view(-1)  # index_select is ~7x faster than advanced indexing here
        k = k_cache.index_select(0, flat).view(nd, -1, kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, flat).view(nd, -1, kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for span in meta.prefills:
        q = query[span.start : span.end].transpose(0, 1).unsqueeze(0)
        if span.mask is None:
            k = key[span.start : span.end].transpose(0, 1).unsqueeze(0)
            v = value[span.start : span.end].transpose(0, 1).unsqueeze(0)
        else:
            k = k_cache.index_select(0, span.block_ids).view(1, -1, kv_heads, head_dim)[:, : span.ctx_len]
            v = v_cache.index_select(0, span.block_ids).view(1, -1, kv_heads, head_dim)[:, : span.ctx_len]
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=span.mask, is_causal=span.mask is None, scale=scaling, enable_gqa=True)
        out[span.start : span.end] = o[0].transpose(0, 1)
    return out


def _no_mask(*args: object, **kwargs: object) -> None:
    """The paged kernel builds its own masks; transformers must not build a dense one."""
    return None


def register() -> str:
    """Register the kernel with transformers (idempotent); returns the implementation name.
    Imported here: a model loaded by engine.direct_model never runs transformers' modules."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
